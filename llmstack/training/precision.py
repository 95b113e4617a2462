"""Mixed precision around DeepSpeed: what the device supports, fp16 loss scaling, its metrics.

fp16 uses DeepSpeed's dynamic loss scaling (`"fp16": {"loss_scale": 0, ...}` in the ds_config):
a step whose gradients overflow is skipped and the scale halves (after `hysteresis` such steps);
`loss_scale_window` clean steps double it again. At `min_loss_scale` it cannot go lower: DeepSpeed
then either skips steps forever (ZeRO stage 0) or raises a bare Exception (stages 1-3).
`LossScaleGuard` makes every stage stop with one clear error after N overflowing steps in a row
at the minimum scale.
"""

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.fp16.loss_scaler import MIN_LOSS_SCALE

from llmstack.errors import UserError


def enable_fp16_on_cpu():
    """Test harness only: let DeepSpeed's CPU accelerator run its real fp16 optimizers and loss
    scaler. The CPU accelerator reports fp16 as unsupported, and `deepspeed.initialize` refuses it."""
    get_accelerator().is_fp16_supported = lambda: True


def check_precision_supported(ds_config):
    """Refuse, before any work starts, a precision the accelerator cannot train in."""
    accelerator = get_accelerator()
    name = accelerator.device_name()
    if ds_config.get("fp16", {}).get("enabled") and not accelerator.is_fp16_supported():
        raise UserError(
            f"the ds_config enables fp16, which DeepSpeed does not support on this device ({name}); "
            "use a bf16 ds_config (ds_configs/bf16_zero*.json) or an fp32 one"
        )
    bf16 = ds_config.get("bf16") or ds_config.get("bfloat16") or {}
    if bf16.get("enabled") and not accelerator.is_bf16_supported():
        raise UserError(
            f"the ds_config enables bf16, which this device ({name}) does not support; "
            "use an fp16 ds_config (ds_configs/fp16_zero*.json) or an fp32 one"
        )


class LossScaleGuard:
    """Stops an fp16 run that overflows on `patience` consecutive steps at the minimum loss scale.

    Call `after_step()` after every `engine.step()`. Does nothing unless the engine uses fp16 with
    dynamic loss scaling.
    """

    def __init__(self, engine, patience=10):
        if patience < 1:
            raise UserError(f"the loss-scale patience must be at least 1 step; got {patience}")
        self.engine = engine
        self.patience = patience
        self.active = engine.fp16_enabled() and engine.dynamic_loss_scale()
        self.overflows_at_min_scale = 0
        if not self.active:
            return
        self.min_scale = engine.dynamic_loss_scale_args()[MIN_LOSS_SCALE]
        self.scale = engine.optimizer.loss_scale
        self.skipped_steps = engine.skipped_steps
        # ZeRO's DynamicLossScaler raises on its first overflow at the minimum scale; this guard
        # takes that decision instead, the same way at every stage.
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if hasattr(scaler, "raise_error_at_min_scale"):
            scaler.raise_error_at_min_scale = False

    def after_step(self):
        if not self.active:
            return
        attempted_scale, self.scale = self.scale, self.engine.optimizer.loss_scale
        overflowed = self.engine.skipped_steps > self.skipped_steps
        self.skipped_steps = self.engine.skipped_steps
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


def loss_scale_metrics(engine):
    """{"loss_scale": current fp16 loss scale, "skipped_steps": updates skipped so far}; the loss
    scale only under fp16."""
    metrics = {"skipped_steps": engine.skipped_steps}
    if engine.fp16_enabled():
        metrics["loss_scale"] = float(engine.optimizer.loss_scale)
    return metrics
