"""The DeepSpeed JSON, completed with the values the run config owns.

A ds_config file describes how to train (ZeRO stage, offload, precision, communication); the run
config says what to train and how fast (batch sizes, learning rate, clipping). This is the one
place where the two meet: the JSON goes to `deepspeed.initialize` untouched except for
`train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, `train_batch_size`,
`gradient_clipping` and the optimizer's lr/betas/eps/weight_decay, which are filled in from the
run config. A value the JSON sets that disagrees with the run config is an error, not silently
overwritten.
"""

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmstack.errors import UserError

if TYPE_CHECKING:
    from llmstack.optim.gradient_compression import GradientCompressor

    from .config import TrainConfig

GRADIENT_COMPRESSION = "gradient_compression"  # the ds_config entry llmstack.optim.initialize reads
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def load_ds_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise UserError(f"DeepSpeed config {path} not found; pick one from ds_configs/ or pass --ds-config PATH")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"DeepSpeed config {path} must be a JSON object")
    return config


def check_batch_sizes(
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_size: int,
    global_batch_size: int | None = None,
    source: str = "run config",
) -> int:
    expected = micro_batch_size * grad_accum_steps * dp_size
    if global_batch_size is not None and global_batch_size != expected:
        raise UserError(
            f"{source}: train_batch_size {global_batch_size} != micro_batch_size {micro_batch_size} "
            f"x grad_accum_steps {grad_accum_steps} x data_parallel_size {dp_size} (= {expected}); "
            "change one of them so the product matches"
        )
    return expected


def complete_ds_config(
    config: dict[str, Any], train: "TrainConfig", dp_size: int, source: str = "ds_config"
) -> dict[str, Any]:
    """Return a copy of `config` with the run config's batch sizes, clipping and optimizer values.
    `dp_size`: the ranks reading different samples. DeepSpeed also counts each sample's context-parallel
    ranks (train.context_parallel_size) as data-parallel: its train_batch_size is the global batch
    times them."""
    if "scheduler" in config:
        raise UserError(
            f"{source} has a 'scheduler' section, but the run config owns the learning-rate schedule "
            "(train.lr, train.min_lr, train.warmup_steps): remove 'scheduler' from the JSON"
        )
    global_batch = check_batch_sizes(train.micro_batch_size, train.grad_accum_steps, dp_size, train.global_batch_size)
    filled = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": global_batch * train.context_parallel_size,
    }
    for key, value in filled.items():
        if key in config and config[key] != value:
            raise UserError(
                f"{source} sets {key}={config[key]} but the run config gives {value} "
                f"(micro_batch_size {train.micro_batch_size} x grad_accum_steps {train.grad_accum_steps} "
                f"x data_parallel_size {dp_size} x context_parallel_size {train.context_parallel_size}); remove "
                f"{key} from the JSON or make them agree"
            )
    config = json.loads(json.dumps(config))
    config.update(filled)
    config["gradient_clipping"] = train.grad_clip
    optimizer = config.setdefault("optimizer", {"type": "AdamW"})
    optimizer.setdefault("params", {}).update(
        lr=train.lr, betas=list(train.betas), eps=train.eps, weight_decay=train.weight_decay
    )
    from llmstack.optim.burst_adamw import settings_from_ds_config
    from llmstack.optim.gradient_compression import compressor_from_spec

    compression = gradient_compression(config, train, source)
    if compression is not None:
        config[GRADIENT_COMPRESSION] = compression
        compressor = compressor_from_spec(compression)
        if compressor is not None and compressor.delivers_bursts:  # BurstAdamW will replace the AdamW
            settings_from_ds_config(optimizer)
    return config


def gradient_compression(config: Mapping[str, Any], train: "TrainConfig", source: str = "ds_config") -> dict | None:
    """The gradient compression the run asks for, {"method", "topk_fraction"(, "warmup_steps",
    "normalize_bursts" for topk)}, or None: from train.gradient_compression, else from the ds_config's
    "gradient_compression" entry. Both set and different is an error."""
    from llmstack.optim.gradient_compression import compressor_from_spec, zero_settings_for_compression

    in_json = config.get(GRADIENT_COMPRESSION)
    if in_json is not None or train.gradient_compression != "none":
        zero_settings_for_compression(config.get("zero_optimization") or {})
    if train.gradient_compression == "none":
        return in_json
    if not 0.0 < train.gradient_compression_topk <= 1.0:
        raise UserError(
            f"train.gradient_compression_topk must lie in (0, 1], e.g. 0.01; got {train.gradient_compression_topk}"
        )
    wanted: dict[str, Any] = {"method": train.gradient_compression, "topk_fraction": train.gradient_compression_topk}
    if train.gradient_compression == "topk":
        warmup = train.gradient_compression_warmup_steps
        if not 0 <= warmup < train.max_steps:
            raise UserError(
                f"train.gradient_compression_warmup_steps ({warmup}) must lie in [0, train.max_steps "
                f"({train.max_steps})): the steps averaged uncompressed before top-k starts"
            )
        wanted["warmup_steps"] = warmup
        wanted["normalize_bursts"] = train.gradient_compression_normalize_bursts
    if in_json is not None and _settings(compressor_from_spec(in_json)) != _settings(compressor_from_spec(wanted)):
        raise UserError(
            f"{source} sets {GRADIENT_COMPRESSION}={in_json} but the run config asks for {wanted} "
            f"(train.gradient_compression, train.gradient_compression_topk, "
            f"train.gradient_compression_warmup_steps, train.gradient_compression_normalize_bursts): "
            f"set it in one place"
        )
    return wanted


def _settings(compressor: "GradientCompressor | None") -> dict[str, Any] | None:
    """What a GradientCompressor (or None) was configured with, its defaults filled in."""
    return None if compressor is None else compressor.settings()


def zero_stage(config: Mapping[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))
