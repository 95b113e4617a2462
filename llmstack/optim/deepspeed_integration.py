"""What a ds_config may name that DeepSpeed itself does not provide: optimizers it no longer has
(DeepSpeed 0.19 rejects `"optimizer": {"type": "OneBitAdam"}`) and compressed gradient averaging
(`"gradient_compression": {"method": "int8" | "topk", "topk_fraction": 0.01, "warmup_steps": 100,
"normalize_bursts": true}`, see gradient_compression; with top-k the ds_config's AdamW becomes
BurstAdamW unless normalize_bursts is false). `initialize` stands in for `deepspeed.initialize`: it resolves the config
first, hands DeepSpeed a ready optimizer, and configures the engine for both:

    engine, optimizer, _, scheduler = initialize(model, ds_config, model.parameters(), mpu=mpu)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import deepspeed
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from llmstack.compat.deepspeed import (
    check_engine,
    data_parallel_group,
    disable_backward_allreduce,
    replace_gradient_reduction,
    replace_stage0_allreduce,
    stateless_optimizer_initialization,
)
from llmstack.errors import UserError

from .burst_adamw import BurstAdamW, settings_from_ds_config
from .gradient_compression import GradientCompressor, compressor_from_spec, zero_settings_for_compression
from .onebit_adam import OneBitAdam
from .overlapped_reduction import DEFAULT_BUCKET_ELEMENTS, OverlappedReduction

if TYPE_CHECKING:  # types only: DeepSpeed's internals are used through llmstack.compat
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader
    from deepspeed.runtime.engine import DeepSpeedEngine

    from llmstack.parallel import Topology

ONEBIT_ADAM = "onebitadam"
ONEBIT_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "freeze_step")
GRADIENT_COMPRESSION = "gradient_compression"  # the ds_config key


def resolve_optimizer(
    ds_config: dict[str, Any],
    model_parameters: ParamsT,
    mpu_or_group: Topology | dist.ProcessGroup | None = None,
    pipeline_stages: int = 1,
    compressor: GradientCompressor | None = None,
) -> tuple[dict[str, Any], OneBitAdam | BurstAdamW | None]:
    """Build the optimizer a ds_config names when it is one of llmstack's, or BurstAdamW in place
    of its AdamW when `compressor` delivers bursts (top-k with normalize_bursts).

    Returns (ds_config, None) when DeepSpeed builds the optimizer itself, else (a copy of ds_config
    without its "optimizer" entry, the optimizer). `mpu_or_group` gives the data-parallel group:
    an mpu with get_data_parallel_group(), a process group, or None for the whole world.
    """
    spec = ds_config.get("optimizer") or {}
    if compressor is not None and compressor.delivers_bursts:
        return _burst_adamw(ds_config, model_parameters, compressor.warmup_steps)
    if str(spec.get("type", "")).lower() != ONEBIT_ADAM:
        return ds_config, None
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage == 3:
        raise UserError(
            "OneBitAdam runs at ZeRO stages 0, 1 and 2, but the ds_config sets zero_optimization.stage=3 "
            "(partitioned weights are gathered per layer, which leaves no whole step to compress): "
            "use stage 2 (ds_configs/onebit_adam_zero2.json) or AdamW with ZeRO-3."
        )
    if pipeline_stages > 1:
        raise UserError(
            f"OneBitAdam cannot be combined with pipeline parallelism ({pipeline_stages} stages): each stage "
            f"would compress only its own layers and the pipeline engine reduces gradients itself. "
            f"Train with 1 pipeline stage or use AdamW."
        )
    params = dict(spec.get("params") or {})
    unknown = sorted(set(params) - set(ONEBIT_ADAM_PARAMS))
    if unknown:
        raise UserError(
            f"unknown OneBitAdam parameter(s) {', '.join(unknown)} in the ds_config; "
            f"accepted: {', '.join(ONEBIT_ADAM_PARAMS)}"
        )
    try:
        optimizer = OneBitAdam(
            model_parameters,
            group=_data_parallel_group(mpu_or_group),
            partition=stage in (1, 2),
            expert_group=_expert_data_parallel_group(mpu_or_group),
            **params,
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"invalid OneBitAdam parameters in the ds_config: {e}") from e
    # At ZeRO 1/2 the partitioning is 1-bit Adam's own: DeepSpeed's ZeRO optimizer would reduce the
    # gradients and gather the weights in full precision, so the engine runs at stage 0 under it.
    resolved = {k: v for k, v in ds_config.items() if k != "optimizer"}
    if stage:
        resolved["zero_optimization"] = {"stage": 0}
    return resolved, optimizer


def _burst_adamw(
    ds_config: dict[str, Any], model_parameters: ParamsT, dense_steps: int
) -> tuple[dict[str, Any], BurstAdamW]:
    """BurstAdamW with the ds_config's AdamW settings (each param group keeps its own), handed to
    DeepSpeed as a client optimizer."""
    try:
        optimizer = BurstAdamW(
            model_parameters, dense_steps=dense_steps, **settings_from_ds_config(ds_config.get("optimizer"))
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"invalid AdamW parameters in the ds_config: {e}") from e
    # DeepSpeed's ZeRO 1/2 optimizer wraps a client optimizer only when told it may.
    resolved = {k: v for k, v in ds_config.items() if k != "optimizer"}
    resolved["zero_allow_untested_optimizer"] = True
    return resolved, optimizer


def initialize(
    model: nn.Module,
    ds_config: dict[str, Any],
    model_parameters: ParamsT,
    mpu: Topology | None = None,
    pipeline_stages: int = 1,
    **kwargs: Any,
) -> tuple[DeepSpeedEngine, Optimizer | DeepSpeedOptimizer | None, DeepSpeedDataLoader | None, Any]:
    """`deepspeed.initialize` for a ds_config that may name one of llmstack's optimizers; `kwargs`
    go to deepspeed.initialize (lr_scheduler, ...). Returns its (engine, optimizer, dataloader,
    lr_scheduler)."""
    ds_config, compressor = resolve_gradient_compression(ds_config)
    overlap_bucket = stage0_overlap_bucket(ds_config)
    ds_config, optimizer = resolve_optimizer(ds_config, model_parameters, mpu, pipeline_stages, compressor)
    with stateless_optimizer_initialization():
        result = deepspeed.initialize(
            model=model, model_parameters=model_parameters, optimizer=optimizer, config=ds_config, mpu=mpu, **kwargs
        )
    check_engine(result[0])
    configure_engine(result[0], compressor, overlap_bucket)
    return result


def configure_engine(
    engine: DeepSpeedEngine, compressor: GradientCompressor | None = None, overlap_bucket: int | None = None
) -> None:
    """Turn off the engine's gradient all-reduce when its optimizer communicates by itself, and
    make it average gradients with `compressor` when one is given; with `overlap_bucket` (ZeRO
    stage 0), in buckets of that many elements while backward runs (OverlappedReduction).

    A no-op for any other optimizer, no compressor and no overlap, so the trainer may always call it.
    """
    if isinstance(engine.basic_optimizer, OneBitAdam):
        if overlap_bucket is not None:
            raise UserError(
                "zero_optimization.overlap_comm at ZeRO stage 0 overlaps the gradient all-reduce, which 1-bit Adam "
                "turns off (it exchanges the compressed momentum in its step): remove overlap_comm"
            )
        disable_backward_allreduce(engine)
    if overlap_bucket is not None:
        reduction = OverlappedReduction(
            engine.module.parameters(),
            data_parallel_group(),
            overlap_bucket,
            engine.is_gradient_accumulation_boundary,
            compressor,
        )
        replace_stage0_allreduce(engine, lambda grads=None, elements_per_buffer=0: reduction.finish())
        _REDUCTIONS[engine] = reduction
    elif compressor is not None:
        replace_gradient_reduction(engine, compressor.average)
    if compressor is not None:
        _COMPRESSORS[engine] = compressor
        reference = weakref.ref(engine)  # the compressor must not keep the engine alive
        compressor.steps_done = lambda: reference().global_steps  # type: ignore[union-attr]


def stage0_overlap_bucket(ds_config: dict[str, Any]) -> int | None:
    """The bucket size (elements) of the overlapped gradient reduction a ZeRO stage 0 ds_config asks
    for with zero_optimization.overlap_comm (reduce_bucket_size, default DEFAULT_BUCKET_ELEMENTS),
    or None. DeepSpeed ignores both keys at stage 0; llmstack implements them there."""
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage", 0) != 0 or not zero.get("overlap_comm", False):
        return None
    bucket = zero.get("reduce_bucket_size", DEFAULT_BUCKET_ELEMENTS)
    if not isinstance(bucket, (int, float)) or bucket < 1:
        raise UserError(f"zero_optimization.reduce_bucket_size must be a positive number of elements; got {bucket!r}")
    return int(bucket)


def optimizer_state_gathered(engine: DeepSpeedEngine) -> contextlib.AbstractContextManager[None]:
    """Enter on every rank around `engine.save_checkpoint`: an optimizer whose state_dict() is a
    collective (1-bit Adam's) gathers once on entry, so that DeepSpeed may ask it on some ranks
    only; a no-op for any other optimizer."""
    optimizer = engine.basic_optimizer
    return optimizer.gathered_state() if isinstance(optimizer, OneBitAdam) else contextlib.nullcontext()


def gradient_compressor(engine: DeepSpeedEngine) -> GradientCompressor | None:
    """The compressor `initialize` gave `engine` (its error feedback is checkpointed), if any."""
    return _COMPRESSORS.get(engine)


def overlapped_reduction(engine: DeepSpeedEngine) -> OverlappedReduction | None:
    """The reduction that overlaps `engine`'s backward pass (ZeRO-0 with overlap_comm), if any."""
    return _REDUCTIONS.get(engine)


_COMPRESSORS: weakref.WeakKeyDictionary[Any, GradientCompressor] = weakref.WeakKeyDictionary()
_REDUCTIONS: weakref.WeakKeyDictionary[Any, OverlappedReduction] = weakref.WeakKeyDictionary()


def resolve_gradient_compression(ds_config: dict[str, Any]) -> tuple[dict[str, Any], GradientCompressor | None]:
    """(ds_config for DeepSpeed, the compressor its "gradient_compression" entry asks for or None).

    The entry is removed (DeepSpeed does not know it); at ZeRO 1/2 the reduction settings the
    compressed reduction replaces are set (zero_settings_for_compression). Which layouts may
    compress is the layout table's to say.
    """
    spec = ds_config.get(GRADIENT_COMPRESSION)
    if spec is None:
        return ds_config, None
    config = {k: v for k, v in ds_config.items() if k != GRADIENT_COMPRESSION}
    compressor = compressor_from_spec(spec)
    if compressor is not None and "zero_optimization" in config:
        config["zero_optimization"] = zero_settings_for_compression(config["zero_optimization"])
    return config, compressor


def _expert_data_parallel_group(mpu_or_group: Topology | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group split experts are averaged over (their expert-data-parallel group), if any."""
    if mpu_or_group is None or isinstance(mpu_or_group, dist.ProcessGroup):
        return None
    return mpu_or_group.expert_data_parallel_group if mpu_or_group.expert_parallel_size > 1 else None


def _data_parallel_group(mpu_or_group: Topology | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if mpu_or_group is None or isinstance(mpu_or_group, dist.ProcessGroup):
        return mpu_or_group
    return mpu_or_group.get_data_parallel_group()
