"""Mixed precision around DeepSpeed: what the device supports, fp16 loss scaling, its metrics.

bf16 on a CPU without native bf16 (see .cpu_bf16) runs about 30x slower than fp32:
`check_precision_supported` refuses such a run before start-up unless `train.allow_emulated_bf16`
is set.

fp16 uses DeepSpeed's dynamic loss scaling (`"fp16": {"loss_scale": 0, ...}` in the ds_config):
a step whose gradients overflow is skipped and the scale halves (after `hysteresis` such steps);
`loss_scale_window` clean steps double it again. At `min_loss_scale` it cannot go lower: DeepSpeed
then either skips steps forever (ZeRO stage 0) or raises a bare Exception (stages 1-3).
`LossScaleGuard` makes every stage stop with one clear error after N overflowing steps in a row
at the minimum scale.
"""

from collections.abc import Callable, Mapping
from typing import Any

from deepspeed.accelerator import get_accelerator

from llmstack.compat.deepspeed import (
    enable_fp16_on_cpu,  # noqa: F401  (the test harness's switch, kept importable here)
    leave_min_loss_scale_to_caller,
    loss_scale,
    min_loss_scale,
    skipped_steps,
)
from llmstack.errors import UserError

from .cpu_bf16 import CpuBf16Report, cpu_bf16_report


def check_precision_supported(
    ds_config: Mapping[str, Any],
    allow_emulated_bf16: bool = False,
    cpu_report: Callable[[], CpuBf16Report] = cpu_bf16_report,
) -> None:
    """Refuse, before any work starts, a precision the accelerator cannot train in (or, for bf16 on
    a CPU without native bf16, only ~30x slower than fp32, unless `allow_emulated_bf16`)."""
    accelerator = get_accelerator()
    name = accelerator.device_name()
    if ds_config.get("fp16", {}).get("enabled") and not accelerator.is_fp16_supported():
        raise UserError(
            f"the ds_config enables fp16, which DeepSpeed does not support on this device ({name}); "
            "use a bf16 ds_config (ds_configs/bf16_zero*.json) or an fp32 one"
        )
    bf16 = ds_config.get("bf16") or ds_config.get("bfloat16") or {}
    if not bf16.get("enabled"):
        return
    if not accelerator.is_bf16_supported():
        raise UserError(
            f"the ds_config enables bf16, which this device ({name}) does not support; "
            "use an fp16 ds_config (ds_configs/fp16_zero*.json) or an fp32 one"
        )
    if name == "cpu" and not allow_emulated_bf16:
        report = cpu_report()
        if not report.native:
            raise UserError(
                f"the ds_config enables bf16, but this CPU has no native bf16: {report.describe()}, so bf16 "
                "training would run many times slower than fp32. Use an fp32 ds_config (ds_configs/zero2.json), "
                "or set train.allow_emulated_bf16: true to train in bf16 anyway"
            )


class LossScaleGuard:
    """Stops an fp16 run that overflows on `patience` consecutive steps at the minimum loss scale.

    Call `after_step()` after every `engine.step()`. Does nothing unless the engine uses fp16 with
    dynamic loss scaling.
    """

    def __init__(self, engine: Any, patience: int = 10) -> None:
        if patience < 1:
            raise UserError(f"the loss-scale patience must be at least 1 step; got {patience}")
        self.engine = engine
        self.patience = patience
        self.active = engine.fp16_enabled() and engine.dynamic_loss_scale()
        self.overflows_at_min_scale = 0
        if not self.active:
            return
        self.min_scale = min_loss_scale(engine)
        self.scale = loss_scale(engine)
        self.skipped_steps = skipped_steps(engine)
        # ZeRO's DynamicLossScaler raises on its first overflow at the minimum scale; this guard
        # takes that decision instead, the same way at every stage.
        leave_min_loss_scale_to_caller(engine)

    def after_step(self) -> None:
        if not self.active:
            return
        attempted_scale, self.scale = self.scale, loss_scale(self.engine)
        overflowed = skipped_steps(self.engine) > self.skipped_steps
        self.skipped_steps = skipped_steps(self.engine)
        if overflowed:
            at_min = attempted_scale <= self.min_scale
            self.overflows_at_min_scale = self.overflows_at_min_scale + 1 if at_min else 0
        elif self.engine.was_step_applied():
            self.overflows_at_min_scale = 0
        if self.overflows_at_min_scale >= self.patience:
            raise UserError(
                f"fp16 gradients overflowed on {self.overflows_at_min_scale} steps in a row at the minimum loss "
                f"scale ({self.min_scale}), so no update is being applied: the model has diverged or its "
                "values exceed fp16's range. Lower the learning rate, enable gradient clipping, or train in "
                "bf16 (ds_configs/bf16_zero*.json); resume from a checkpoint before the divergence"
            )


def loss_scale_metrics(engine: Any) -> dict[str, float]:
    """{"loss_scale": current fp16 loss scale, "skipped_steps": updates skipped so far}; the loss
    scale only under fp16."""
    metrics: dict[str, float] = {"skipped_steps": skipped_steps(engine)}
    if engine.fp16_enabled():
        metrics["loss_scale"] = loss_scale(engine)
    return metrics
