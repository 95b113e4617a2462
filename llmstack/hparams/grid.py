"""The trials of a sweep: `--grid section.key=v1,v2,...` and `--range section.key=LOW:HIGH[:log]`.

A grid alone is the Cartesian product of its values, in the order given. With `--samples K`
the sweep is a random search: K points drawn from a seeded generator, each range sampled
uniformly (on a log scale with `:log`) and each grid's values picked uniformly. A trial is a
mapping {section.key: value as written on a command line}, so it is also the override that
`llmstack train` takes.
"""

import itertools
import math
import random
from dataclasses import dataclass

import yaml

from llmstack.errors import UserError

SCALES = ("lin", "log")


@dataclass(frozen=True)
class Choice:
    """A grid axis: a key and the values (strings, as written) it takes."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Range:
    """A random-search axis: uniform in [low, high], on a log scale for `log`; integers when both
    bounds are written as integers."""

    key: str
    low: float
    high: float
    scale: str
    integer: bool

    def sample(self, rng: random.Random) -> str:
        if self.scale == "log":
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        return str(round(value)) if self.integer else f"{value:.3g}"


def _split_key(spec: str, option: str, example: str) -> tuple[str, str]:
    key, sep, rest = spec.partition("=")
    parts = key.split(".")
    if not sep or len(parts) != 2 or not all(p.isidentifier() for p in parts) or not rest:
        raise UserError(f"{option} {spec!r} must look like {example}")
    return key, rest


def parse_grid(spec: str) -> Choice:
    """`train.lr=1e-4,3e-4,1e-3` -> Choice("train.lr", ("1e-4", "3e-4", "1e-3"))."""
    key, rest = _split_key(spec, "--grid", "section.key=v1,v2,... (e.g. train.lr=1e-4,3e-4,1e-3)")
    values = tuple(v.strip() for v in rest.split(","))
    if not all(values):
        raise UserError(f"--grid {spec!r} has an empty value")
    if len(set(values)) != len(values):
        raise UserError(f"--grid {spec!r} repeats a value")
    return Choice(key, values)


def parse_range(spec: str) -> Range:
    """`train.lr=1e-4:1e-2:log` -> Range("train.lr", 1e-4, 1e-2, "log", integer=False)."""
    example = "section.key=LOW:HIGH[:log] (e.g. train.lr=1e-4:1e-2:log)"
    key, rest = _split_key(spec, "--range", example)
    parts = rest.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in SCALES):
        raise UserError(f"--range {spec!r} must look like {example}; the scale is lin or log")
    bounds = [yaml.safe_load(p) if p.strip() else None for p in parts[:2]]
    try:
        low, high = (float(b) for b in bounds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UserError(f"--range {spec!r}: LOW and HIGH must be numbers") from None
    scale = parts[2] if len(parts) == 3 else "lin"
    if not low < high or (scale == "log" and low <= 0):
        raise UserError(f"--range {spec!r}: LOW must be below HIGH (and above 0 on a log scale)")
    return Range(key, low, high, scale, integer=all(isinstance(b, int) for b in bounds))


def check_distinct(keys: list[str]) -> None:
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise UserError(f"{', '.join(repeated)} is swept twice: give each key one --grid or --range")


def grid_trials(choices: list[Choice]) -> list[dict[str, str]]:
    """Every combination of the grids' values, the first grid varying slowest."""
    check_distinct([c.key for c in choices])
    return [dict(zip([c.key for c in choices], combo)) for combo in itertools.product(*(c.values for c in choices))]


def random_trials(choices: list[Choice], ranges: list[Range], samples: int, seed: int) -> list[dict[str, str]]:
    """`samples` points drawn with random.Random(seed): the same arguments give the same trials."""
    check_distinct([c.key for c in choices] + [r.key for r in ranges])
    if samples < 1:
        raise UserError(f"--samples must be at least 1; got {samples}")
    rng = random.Random(seed)
    trials = []
    for _ in range(samples):
        trial = {c.key: rng.choice(c.values) for c in choices}
        trial.update({r.key: r.sample(rng) for r in ranges})
        trials.append(trial)
    return trials
