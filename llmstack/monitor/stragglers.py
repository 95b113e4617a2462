"""Stragglers: a rank whose own time per step stands out against the other ranks'.

In synchronous training every rank's wall time per step is the same: the fast ranks wait for the
slow one in the gradient all-reduce. What differs is the time a rank spends before it can wait for
anybody, its *own* time: waiting for its data plus the forward pass, which under data parallelism
and ZeRO-1/2 runs no collective. (Under ZeRO-3, tensor, expert or pipeline parallelism the forward
pass also waits for peers, which hides a rank that computes slowly; one that reads slowly still
shows.) The slowest rank's own time over the median of the other ranks' is the straggler ratio.
"""

import logging
import statistics
from collections.abc import Sequence

logger = logging.getLogger(__name__)

NO_STRAGGLER = -1  # the straggler/rank metric when no rank is slower than the factor
# A slow rank is a straggler only when its lateness costs at least this share of the step.
MIN_STEP_SHARE = 0.1


def own_time(phases: dict[str, float]) -> float:
    """A rank's own seconds per step from StepTimer's phases (a pipeline engine's step is one phase)."""
    return phases.get("time/data", 0.0) + phases.get("time/forward", phases.get("time/pipeline", 0.0))


class StragglerWatch:
    """Names a rank a straggler once it has been the slowest, at `factor` or more times the other
    ranks' median and late by MIN_STEP_SHARE of the step or more, in `patience` logging intervals
    in a row: one slow interval is often a busy machine (another process, a page-cache flush), not
    a slow rank, and a rank 2x slower at something that takes 1% of the step costs nothing."""

    def __init__(self, factor: float, patience: int = 3) -> None:
        self.factor, self.patience = factor, patience
        self.suspect, self.intervals = NO_STRAGGLER, 0

    def metrics(self, own_s: Sequence[float], data_s: Sequence[float], step_s: float) -> dict[str, float]:
        """`straggler/ratio` (the slowest rank's own time over the other ranks' median),
        `straggler/rank` (that rank once named, else NO_STRAGGLER) and its data wait; naming is
        also a warning. `own_s[r]`, `data_s[r]`: rank r's seconds per step in this interval;
        `step_s`: the wall time per step."""
        slowest = max(range(len(own_s)), key=own_s.__getitem__)
        others = statistics.median(t for r, t in enumerate(own_s) if r != slowest)
        ratio = own_s[slowest] / others if others > 0 else 1.0
        late = own_s[slowest] - others >= MIN_STEP_SHARE * step_s
        slow = self.factor > 0 and ratio >= self.factor and late
        self.intervals = self.intervals + 1 if slow and slowest == self.suspect else int(slow)
        self.suspect = slowest if slow else NO_STRAGGLER
        named = self.intervals >= self.patience
        if named:
            logger.warning(
                "rank %d is a straggler: %.1fx the other ranks' median own time per step for %d logging "
                "intervals (data wait plus forward pass: %.3f s against %.3f s, %.3f s of it waiting for data)",
                slowest,
                ratio,
                self.intervals,
                own_s[slowest],
                others,
                data_s[slowest],
            )
        return {
            "straggler/ratio": ratio,
            "straggler/rank": slowest if named else NO_STRAGGLER,
            "straggler/data_wait_s": data_s[slowest],
        }
