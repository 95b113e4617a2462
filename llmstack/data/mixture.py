"""Mixtures of named sources, and each source's actual share of tokens against its target weight.

A mixture source is a mapping: `{name, weight, ...}` plus what locates its data (`paths` of raw
documents for the training stream, `prefixes` of packed shards for `data.train`). Names are
unique (they name the `data_share/NAME` metrics); a source without a name is named by its paths.
A weight is the source's share of the trained *tokens* by default (`weight_by: tokens`, as every
published mixture is given); `weight_by: documents` makes it a share of the documents instead.

A weight schedule (`data.schedule`, `WeightSchedule`) changes the weights with the training step:
the sources' weights hold until its first point, then each point's weights, linearly interpolated
towards the next point (`interpolation: linear`) or held until it (`step`); after the last point
its weights hold. A source a point does not name weighs 0 there.

Seed 002's rule: a source whose share deviates from its target by more than 20% of the target
(0.30 target: outside 0.24..0.36) is a warning that names it. `data pack --weights` and the
training stream (`MixtureStream.token_shares`) report shares this way.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from llmstack.errors import UserError

logger = logging.getLogger(__name__)

MAX_DEVIATION = 0.2
WEIGHT_BY = ("tokens", "documents")
INTERPOLATIONS = ("linear", "step")


def check_weight_by(weight_by: str, where: str = "data.weight_by") -> str:
    if weight_by not in WEIGHT_BY:
        raise UserError(f"{where} must be one of {', '.join(WEIGHT_BY)}; got {weight_by!r}")
    return weight_by


def source_names(sources: Sequence[Any], location: str, keys: Sequence[str], where: str = "data.sources") -> list[str]:
    """Check mixture `sources` (mappings with `location`, optional `name` and `weight`, and only
    `keys` besides) and return their names: each one's `name`, or its `location` as text. Names
    must be unique and weights positive numbers; anything else is one UserError saying what to fix."""
    if not sources:
        raise UserError(f"{where} needs at least one source: [{{name: ..., {location}: ..., weight: ...}}]")
    allowed = {"name", location, "weight", *keys}
    names = []
    for i, source in enumerate(sources):
        if not isinstance(source, Mapping) or location not in source or set(source) - allowed:
            raise UserError(
                f"{where}[{i}] must be a mapping with `{location}` and optionally "
                f"{', '.join(sorted(allowed - {location}))}; got {source!r}"
            )
        weight = source.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise UserError(f"{where}[{i}] weight must be a positive number; got {weight!r}")
        name = source.get("name", source[location])
        if "name" in source and (not isinstance(name, str) or not name.strip()):
            raise UserError(f"{where}[{i}] name must be a non-empty string; got {name!r}")
        names.append(name if isinstance(name, str) else str(name))
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(
            f"{where}: source names must be unique, and {', '.join(map(repr, repeated))} is used more than "
            f"once; give each entry its own `name:`"
        )
    return names


def weights_of(sources: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each source's weight over the sum of weights (a source without `weight` weighs 1)."""
    weights = [float(s.get("weight", 1.0)) for s in sources]
    return [w / sum(weights) for w in weights]


class WeightSchedule:
    """Each source's share as a piecewise-linear function of the step x >= 0 (fractional steps
    allowed): `shares` (points x sources, each row summing to 1) hold from each of `steps`
    (increasing, the first 0) on, moving linearly towards the next row where `slopes` says so
    (the last row holds for ever). `integral(x)` is each share's integral from 0 to x and
    `reaching(s, z)` the first step at which source s's integral reaches z: a mixture draws
    source s's k-th sample or token where its integral reaches k + 1/2."""

    def __init__(self, names: Sequence[str], steps: Any, shares: Any, linear: Sequence[bool]) -> None:
        self.names = list(names)
        self.steps = np.asarray(steps, dtype=np.float64)
        rows = np.asarray(shares, dtype=np.float64)
        self.shares = rows / rows.sum(axis=1, keepdims=True)
        self.linear = list(linear)
        widths = np.diff(self.steps)
        self.slopes = np.zeros_like(self.shares)
        for j, ramp in enumerate(self.linear[: len(widths)]):
            if ramp:
                self.slopes[j] = (self.shares[j + 1] - self.shares[j]) / widths[j]
        pieces = self.shares[:-1] * widths[:, None] + self.slopes[:-1] * widths[:, None] ** 2 / 2
        self.cumulative = np.concatenate([np.zeros((1, len(self.names))), np.cumsum(pieces, axis=0)])

    @classmethod
    def constant(cls, names: Sequence[str], weights: Sequence[float]) -> "WeightSchedule":
        return cls(names, [0], [list(weights)], [False])

    @classmethod
    def from_config(
        cls, schedule: Mapping[str, Any] | None, names: Sequence[str], weights: Sequence[float], where: str
    ) -> "WeightSchedule":
        """The schedule of `data.schedule` ({interpolation, points: [{step, weights: {name: w}}]})
        over sources `names` whose own `weights` hold until its first point; no schedule (None or
        {}): those weights for ever. Anything malformed is one UserError saying what to fix."""
        if not schedule:
            return cls.constant(names, weights)
        example = "{interpolation: linear, points: [{step: 900, weights: {web: 0.7, wiki: 0.3}}, ...]}"
        if not isinstance(schedule, Mapping) or set(schedule) - {"interpolation", "points"}:
            raise UserError(f"{where} must be a mapping {example}; got {schedule!r}")
        interpolation = schedule.get("interpolation", "linear")
        if interpolation not in INTERPOLATIONS:
            raise UserError(f"{where}.interpolation must be one of {', '.join(INTERPOLATIONS)}; got {interpolation!r}")
        points = schedule.get("points")
        if not isinstance(points, Sequence) or isinstance(points, str) or not points:
            raise UserError(f"{where}.points must be a non-empty list like {example}; got {points!r}")
        steps, rows, from_points = [0], [list(weights)], [False]
        for i, point in enumerate(points):
            if not isinstance(point, Mapping) or set(point) != {"step", "weights"}:
                raise UserError(f"{where}.points[{i}] must be a mapping {{step: ..., weights: {{name: weight}}}}")
            step, given = point["step"], point["weights"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0 or (i and step <= steps[-1]):
                raise UserError(
                    f"{where}.points[{i}].step must be a whole number >= 0, greater than the step before it; "
                    f"got {step!r}"
                )
            if not isinstance(given, Mapping) or not given:
                raise UserError(f"{where}.points[{i}].weights must map source names to weights; got {given!r}")
            unknown = sorted(map(str, set(given) - set(names)))
            if unknown:
                raise UserError(
                    f"{where}.points[{i}].weights names {', '.join(map(repr, unknown))}, not a source of this "
                    f"mixture (its sources: {', '.join(map(repr, names))})"
                )
            for name, w in given.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
                    raise UserError(f"{where}.points[{i}].weights.{name} must be a number >= 0; got {w!r}")
            if not sum(given.values()) > 0:
                raise UserError(f"{where}.points[{i}].weights must sum to more than 0; got {dict(given)}")
            if step == 0:  # replaces the sources' weights
                steps, rows, from_points = [], [], []
            steps.append(step)
            rows.append([float(given.get(name, 0.0)) for name in names])
            from_points.append(True)
        # the sources' weights hold up to the first point; from each point on, as `interpolation` says
        linear = [interpolation == "linear" and p for p in from_points]
        return cls(names, steps, rows, linear)

    def to_dict(self) -> dict[str, Any]:
        """JSON that names the schedule (equal schedules give equal dicts)."""
        return {
            "names": self.names,
            "steps": self.steps.tolist(),
            "shares": self.shares.tolist(),
            "linear": self.linear,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "WeightSchedule":
        return cls(state["names"], state["steps"], state["shares"], state["linear"])

    def scaled(self, factors: Sequence[float]) -> "WeightSchedule":
        """The schedule of shares proportional to share x factor (as weights by documents become
        shares of samples), interpolated between the same points."""
        return WeightSchedule(self.names, self.steps, self.shares * np.asarray(factors), self.linear)

    def _piece(self, x: Any) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        j = np.searchsorted(self.steps, x, side="right") - 1
        return j, np.asarray(x, dtype=np.float64) - self.steps[j]

    def at(self, step: float) -> npt.NDArray[np.float64]:
        """Each source's share at `step`."""
        j, d = self._piece(step)
        return self.shares[j] + self.slopes[j] * d

    def integral(self, step: float) -> npt.NDArray[np.float64]:
        """Each source's share integrated over steps [0, step]."""
        j, d = self._piece(step)
        return self.cumulative[j] + self.shares[j] * d + self.slopes[j] * d * d / 2

    def reaching(self, s: int, z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """The first step at which source s's integral reaches each of `z` (inf: never)."""
        z = np.asarray(z, dtype=np.float64)
        j = np.maximum(np.searchsorted(self.cumulative[:, s], z, side="left") - 1, 0)
        rest = np.maximum(z - self.cumulative[j, s], 0.0)
        a, b = self.shares[j, s], self.slopes[j, s]
        with np.errstate(divide="ignore", invalid="ignore"):
            d = 2 * rest / (a + np.sqrt(np.maximum(a * a + 2 * b * rest, 0.0)))
        d = np.where(rest == 0, 0.0, d)
        return np.where(np.isfinite(d), self.steps[j] + d, np.inf)


@dataclass(frozen=True)
class SourceShare:
    source: str
    target: float  # the weight's share of all weights
    tokens: int
    share: float  # the tokens' share of all tokens

    @property
    def deviation(self) -> float:
        """(share - target) / target: 0.25 means 25% more than the target."""
        return self.share / self.target - 1 if self.target else 0.0


def token_shares(tokens: dict, weights: dict) -> list[SourceShare]:
    """One `SourceShare` per source of `weights` ({source: weight}), from `tokens` ({source: count})."""
    total_tokens, total_weight = sum(tokens.values()), sum(weights.values())
    return [
        SourceShare(
            source,
            weight / total_weight,
            tokens.get(source, 0),
            tokens.get(source, 0) / total_tokens if total_tokens else 0.0,
        )
        for source, weight in weights.items()
    ]


def unbalanced(shares: list[SourceShare], max_deviation: float = MAX_DEVIATION) -> list[SourceShare]:
    """The sources further than `max_deviation` (relative) from their targets, each logged as a warning."""
    off = [s for s in shares if abs(s.deviation) > max_deviation]
    for s in off:
        logger.warning(
            "mixture source %s has %.1f%% of the tokens against a target of %.1f%% (%+.0f%%, more than %.0f%% off)",
            s.source,
            100 * s.share,
            100 * s.target,
            100 * s.deviation,
            100 * max_deviation,
        )
    return off


def format_shares(shares: list[SourceShare]) -> str:
    rows = [f"{'source':<40}{'tokens':>14}{'share':>9}{'target':>9}{'deviation':>11}"]
    rows += [f"{s.source:<40}{s.tokens:>14,}{s.share:>9.1%}{s.target:>9.1%}{s.deviation:>+11.0%}" for s in shares]
    return "\n".join(rows)
