"""Mixtures of named sources, and each source's actual share of tokens against its target weight.

A mixture source is a mapping: `{name, weight, ...}` plus what locates its data (`paths` of raw
documents for the training stream, `prefixes` of packed shards for `data.train`). Names are
unique (they name the `data_share/NAME` metrics); a source without a name is named by its paths.
A weight is the source's share of the trained *tokens* by default (`weight_by: tokens`, as every
published mixture is given); `weight_by: documents` makes it a share of the documents instead.

Seed 002's rule: a source whose share deviates from its target by more than 20% of the target
(0.30 target: outside 0.24..0.36) is a warning that names it. `data pack --weights` and the
training stream (`MixtureStream.token_shares`) report shares this way.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmstack.errors import UserError

logger = logging.getLogger(__name__)

MAX_DEVIATION = 0.2
WEIGHT_BY = ("tokens", "documents")


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
