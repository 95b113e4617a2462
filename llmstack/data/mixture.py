"""Mixture balance: each source's actual share of tokens against its target weight.

Seed 002's rule: a source whose share deviates from its target by more than 20% of the target
(0.30 target: outside 0.24..0.36) is a warning that names it. `data pack --weights` and the
training stream (`MixtureStream.token_shares`) report shares this way.
"""

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_DEVIATION = 0.2


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
