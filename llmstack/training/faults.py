"""Faults a long run survives without a person: non-finite losses, loss spikes, preemption.

After every optimizer step the ranks agree, in one small all-reduce, on what happens next
(`FaultGuard.after_step`), so that no rank saves, rolls back or stops without the others:

- A skipped update outside fp16 loss scaling (which skips overflowing steps itself): a NaN/inf
  loss gives a non-finite gradient norm, which DeepSpeed treats as an overflow at ZeRO stages 1-3
  and in bf16, skipping the update. The guard counts such steps and stops the run after
  `max_nonfinite_steps` in a row. A non-finite loss whose update was applied anyway (a setup
  without that check) stops the run at once: the weights are no longer finite.
- A loss spike (the mean loss above `loss_spike_factor` times the mean of the previous
  `loss_spike_window` steps): roll back to the last checkpoint and skip the data that led to the
  spike, as the PaLM and OPT runs did by hand.
- SIGTERM/SIGINT (a preempted instance): finish the step, save, stop. A watchdog ends the process
  `sigterm_grace_s` seconds after the signal if that save has not finished. The handler stays
  installed until the save is done: a scheduler signals every process of the job and the deepspeed
  launcher forwards its own copy, so each rank gets the signal twice within milliseconds, and
  operators repeat it. Signals less than `REPEAT_WINDOW_S` after the previous one are the same
  request; the third request (three signals, each at least that far apart) ends the process at
  once, without the save, as SIGKILL does.
"""

import logging
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist

from llmstack.errors import UserError

from .config import TrainConfig

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Signals closer than this to the previous one are copies of one request (the group's and the
# launcher's); the STOP_AT_ONCE-th request ends the process without saving.
REPEAT_WINDOW_S = 1.0
STOP_AT_ONCE = 3


@dataclass
class Verdict:
    """What every rank does after a step."""

    mean_loss: float  # over data-parallel ranks; nan when any rank's loss was not finite
    rollback: bool = False  # reload the last checkpoint, keep the data position
    save: bool = False
    stop_signal: int = 0  # a signal (on any rank) asked the run to end, after saving


class FaultGuard:
    def __init__(
        self, cfg: TrainConfig, fp16: bool, device: torch.device | str, group: dist.ProcessGroup | None = None
    ) -> None:
        if cfg.max_nonfinite_steps < 1:
            raise UserError(f"train.max_nonfinite_steps must be at least 1; got {cfg.max_nonfinite_steps}")
        if cfg.loss_spike_factor and (cfg.loss_spike_factor <= 1 or cfg.loss_spike_window < 1):
            raise UserError(
                "train.loss_spike_factor must be above 1 (0 turns the guard off) and train.loss_spike_window "
                f"at least 1; got {cfg.loss_spike_factor} and {cfg.loss_spike_window}"
            )
        self.max_nonfinite_steps = cfg.max_nonfinite_steps
        self.spike_factor = cfg.loss_spike_factor
        self.recent_losses: deque[float] = deque(maxlen=cfg.loss_spike_window)
        self.grace_s = cfg.sigterm_grace_s
        self.fp16 = fp16
        self.device = device
        self.group = group
        self.counters = {"skipped_steps": 0, "rollbacks": 0, "skipped_samples": 0}
        self.skipped_in_a_row = 0
        self.signal: int | None = None
        self._requests = 0  # signals that were not copies of the previous one
        self._last_signal_at = -math.inf
        self._handlers: dict[signal.Signals, Any] = {}
        self._watchdog: threading.Timer | None = None

    # ---- signals: installed for the training loop only

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._handlers = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._handlers.items():
            # None: the previous handler was installed from C, not Python; the default is the
            # closest we can restore.
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._handlers = {}
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _on_signal(self, signum: int, frame: object) -> None:
        now, previous = time.monotonic(), self._last_signal_at
        self._last_signal_at = now
        name = signal.Signals(signum).name
        if now - previous < REPEAT_WINDOW_S:
            return  # a copy of the request being served
        self._requests += 1
        if self._requests >= STOP_AT_ONCE:
            logger.error("%s, request %d: stopping at once, without saving", name, self._requests)
            os._exit(128 + signum)
        if self.signal is not None:
            logger.warning(
                "%s again: the checkpoint is still being saved (a signal %gs or more after this one stops "
                "at once, without it)",
                name,
                REPEAT_WINDOW_S,
            )
            return
        self.signal = signum
        self._watchdog = threading.Timer(self.grace_s, self._out_of_time)
        self._watchdog.daemon = True
        self._watchdog.start()
        logger.warning("%s: saving a checkpoint after this step, then stopping (grace period %gs)", name, self.grace_s)

    def _out_of_time(self) -> None:
        logger.error("the %gs grace period ran out before the checkpoint was saved; exiting", self.grace_s)
        assert self.signal is not None  # the watchdog starts only after a signal
        os._exit(128 + self.signal)

    # ---- after each step

    def after_step(self, step: int, loss: float, step_applied: bool, save_due: bool) -> Verdict:
        """Collective. `loss`: this rank's loss; `step_applied`: whether the engine updated the
        weights; `save_due`: whether this rank thinks a checkpoint is due."""
        finite = math.isfinite(loss)
        flags = torch.tensor(
            [loss if finite else 0.0, not finite, save_due, *(self.signal == s for s in SIGNALS)],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(flags, group=self.group)  # summed: each flag counts the ranks that raised it
        loss_sum, nonfinite, save, *signalled = flags.tolist()
        stop_signal = next((int(s) for s, count in zip(SIGNALS, signalled) if count), 0)
        verdict = Verdict(
            mean_loss=math.nan if nonfinite else loss_sum / dist.get_world_size(self.group),
            save=bool(save or stop_signal),
            stop_signal=stop_signal,
        )

        if nonfinite and step_applied and not self.fp16:
            raise UserError(
                f"step {step}: the loss is not finite and the update was applied (this DeepSpeed setup does "
                "not skip steps with non-finite gradients; use ZeRO stage >= 1 or bf16); rerun with "
                "--resume auto to continue from the last checkpoint"
            )
        if not step_applied:
            self.counters["skipped_steps"] += 1
            self.skipped_in_a_row += 1
            if not self.fp16 and self.skipped_in_a_row >= self.max_nonfinite_steps:
                raise UserError(
                    f"stopping at step {step}: {self.skipped_in_a_row} steps in a row had a non-finite loss or "
                    "gradient and were skipped (train.max_nonfinite_steps); lower train.lr, check the data, "
                    "or resume from an earlier checkpoint"
                )
            return verdict
        self.skipped_in_a_row = 0
        if self.is_spike(verdict.mean_loss):
            verdict.rollback = True
            if dist.get_rank(self.group) == 0:
                logger.warning(
                    "step %d: loss %.4g is over %g x the mean %.4g of the last %d steps: rolling back to the "
                    "last checkpoint and skipping the data since",
                    step,
                    verdict.mean_loss,
                    self.spike_factor,
                    sum(self.recent_losses) / len(self.recent_losses),
                    len(self.recent_losses),
                )
            return verdict
        self.recent_losses.append(verdict.mean_loss)
        return verdict

    def is_spike(self, mean_loss: float) -> bool:
        window = self.recent_losses
        return (
            bool(self.spike_factor)
            and len(window) == window.maxlen
            and mean_loss > self.spike_factor * sum(window) / len(window)
        )

    def rolled_back(self, skipped_samples: int) -> None:
        self.counters["rollbacks"] += 1
        self.counters["skipped_samples"] += skipped_samples

    def state_dict(self) -> dict[str, Any]:
        return {**self.counters, "skipped_in_a_row": self.skipped_in_a_row, "recent_losses": list(self.recent_losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counters = {k: state.get(k, 0) for k in self.counters}
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)
        self.recent_losses.clear()
        self.recent_losses.extend(state.get("recent_losses", []))
