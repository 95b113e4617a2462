"""Every DeepSpeed internal llmstack uses, each behind one function: private engine and optimizer
attributes, internal modules and classes, the names of checkpoint files, undocumented switches.

Importing this module checks the installed DeepSpeed (`check_installed`); `check_engine` checks
what an engine built by `deepspeed.initialize` must have (llmstack.optim.initialize calls it).
Either stops with one IncompatibleLibraryError naming the supported range (SUPPORTED_DEEPSPEED).
"""

import argparse
import contextlib
import copy
import functools
import importlib
import inspect
import io
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from . import IncompatibleLibraryError, SupportedRange, missing_attributes

# Floor 0.19.8. Read in the released sources: the CheckpointEngine interface ManifestCheckpointEngine
# implements (abstract create/save/load/commit, CheckpointCommitInfo) exists from 0.17.6, not in
# 0.17.0, and tests/test_compat.py's engine tests pass on the sources of 0.18.9 and 0.19.0. But with
# 0.19.0 and 0.19.4, tests/test_checkpoint_runs.py's run with NaN losses stops at the first one
# (apparently the update is not skipped, which llmstack.training.faults relies on; not traced
# further). 0.19.5-0.19.7 are untested; 0.19.8 passes the suite. Ceiling: below 0.20, whose
# internals may move.
SUPPORTED_DEEPSPEED = SupportedRange("deepspeed", ">=0.19.8,<0.20")

# Internal modules and the names llmstack takes from them (checked on import, used via `_internal`).
INTERNAL_NAMES = {
    "deepspeed.runtime.checkpoint_engine.checkpoint_engine": ("CheckpointEngine",),
    "deepspeed.checkpoint.ds_to_universal": ("main", "parse_arguments"),
    "deepspeed.checkpoint.constants": (
        "UNIVERSAL_CHECKPOINT_VERSION_KEY",
        "TP_REPLICATED_PARAMETER_PATTERNS",
        "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
        "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
        "DS_AUTOTP_UC_META",
        "CHECKPOINT_PARALLEL_DIMS",
        "CHECKPOINT_TP_DEGREE",
        "PARAM_SHAPES",
        "OPTIMIZER_STATE_DICT",
        "FP32_FLAT_GROUPS",
    ),
    "deepspeed.runtime.fp16.loss_scaler": (
        "MIN_LOSS_SCALE",
        "DynamicLossScaler",
        "LossScaler",
    ),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
    "deepspeed.utils.zero_to_fp32": ("get_fp32_state_dict_from_zero_checkpoint",),
    "deepspeed.runtime.activation_checkpointing.checkpointing": ("get_cuda_rng_tracker",),
    "deepspeed.runtime.pipe.topology": ("PipeModelDataParallelTopology",),
    "deepspeed.runtime.base_optimizer": ("ZeROOptimizer",),
    "deepspeed.runtime.zero.stage_1_and_2": ("DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs"),
    "deepspeed.runtime.zero.stage3": ("DeepSpeedZeroOptimizer_Stage3", "estimate_zero3_model_states_mem_needs"),
    "deepspeed.runtime.bf16_optimizer": ("BF16_Optimizer",),
    "deepspeed.runtime.fp16.fused_optimizer": ("FP16_Optimizer",),
    "deepspeed.runtime.fp16.unfused_optimizer": ("FP16_UnfusedOptimizer",),
    "deepspeed.runtime.utils": ("is_model_parallel_parameter",),
    "deepspeed.git_version_info": ("installed_ops",),
    "deepspeed.ops.op_builder.all_ops": ("ALL_OPS",),
    "deepspeed.utils.groups": (
        "_EXPERT_PARALLEL_GROUP",
        "_EXPERT_PARALLEL_GROUP_RANKS",
        "_EXPERT_DATA_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
        "_get_expert_parallel_rank",
        "_get_expert_data_parallel_rank",
        "_get_data_parallel_group",
    ),
    "deepspeed.moe.utils": ("split_params_into_different_moe_groups_for_optimizer",),
    # ZeRO-3 takes MoE layers of this class only, and partitions the parameters they mark.
    "deepspeed.module_inject.auto_ep_layer": ("AutoEPMoELayer",),
    # The engine recognises MoE layers by `isinstance(module, MoE)` with this module's name `MoE`.
    "deepspeed.runtime.engine": ("DeepSpeedEngine", "MoE"),
}
# The methods DeepSpeed's CheckpointEngine may leave to subclasses (ManifestCheckpointEngine defines them).
CHECKPOINT_ENGINE_ABSTRACT = frozenset({"create", "save", "load", "commit"})
# Attributes of a DeepSpeedEngine instance that llmstack reads or sets through this module.
ENGINE_ATTRIBUTES = ("_config", "enable_backward_allreduce", "checkpoint_engine", "skipped_steps")
# Undocumented public attributes of an engine that llmstack reads directly (checked, not wrapped).
ENGINE_PLAIN_ATTRIBUTES = (
    "module",
    "optimizer",
    "basic_optimizer",
    "device",
    "dp_world_size",
    "mp_world_size",
    "global_steps",
    "global_samples",
)
# Where each ZeRO optimizer keeps this rank's fp32 master partitions and its gradient partitions
# besides `.grad` (reduced partitions; the CPU-offload copies; stage 3's flat buffer). Checked in
# subclass-first order. Outside step() stage 3 leaves its inner optimizer's param groups empty.
ZERO_STATE_ATTRIBUTES = {
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"): (
        ("fp32_partitioned_groups_flat",),
        ("averaged_gradients", "grad_partitions_flat_buffer"),
    ),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"): (
        ("single_partition_of_fp32_groups",),
        ("averaged_gradients", "offload_gradient_dict"),
    ),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"): (
        ("fp32_groups_flat_partition",),
        ("fp32_groups_gradients_flat",),
    ),
}


def _internal(module: str, name: str) -> Any:
    """`module.name`, one of the INTERNAL_NAMES that check_installed verified."""
    assert name in INTERNAL_NAMES[module], f"{module}.{name} is not listed in INTERNAL_NAMES"
    return getattr(importlib.import_module(module), name)


def _incompatible(what: str) -> IncompatibleLibraryError:
    error = SUPPORTED_DEEPSPEED.error(deepspeed.__version__, [what])
    assert error is not None
    return error


def _attribute(obj: object, name: str) -> Any:
    """obj.name, or the IncompatibleLibraryError saying DeepSpeed no longer has it."""
    if not hasattr(obj, name):
        raise _incompatible(f"{type(obj).__name__}.{name}")
    return getattr(obj, name)


# ---- the installed library


def check_installed() -> None:
    """Stop with IncompatibleLibraryError unless the installed DeepSpeed is in the supported range
    and has every internal module, class and attribute llmstack uses."""
    SUPPORTED_DEEPSPEED.check(deepspeed.__version__)
    SUPPORTED_DEEPSPEED.check(deepspeed.__version__, installed_problems())


def installed_problems() -> list[str]:
    """What the installed DeepSpeed lacks of what llmstack uses (an empty list when nothing)."""
    missing = []
    for module_name, names in INTERNAL_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            missing.append(f"module {module_name} ({e})")
            continue
        missing += missing_attributes(module, names, module_name)
    if missing:
        return missing
    abstract = set(
        _internal("deepspeed.runtime.checkpoint_engine.checkpoint_engine", "CheckpointEngine").__abstractmethods__
    )
    if not abstract <= CHECKPOINT_ENGINE_ABSTRACT:
        missing.append(
            f"CheckpointEngine with no abstract methods beyond {sorted(CHECKPOINT_ENGINE_ABSTRACT)}: {sorted(abstract)}"
        )
    scaler = _internal("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
    if "raise_error_at_min_scale" not in inspect.signature(scaler.__init__).parameters:
        missing.append("DynamicLossScaler(raise_error_at_min_scale=...)")
    topology = _internal("deepspeed.runtime.pipe.topology", "PipeModelDataParallelTopology")
    missing += missing_attributes(
        topology,
        ("get_coord", "get_axis_comm_lists", "filter_match"),
        "PipeModelDataParallelTopology",
    )
    engine_class = _internal("deepspeed.runtime.engine", "DeepSpeedEngine")
    missing += missing_attributes(
        engine_class,
        ("load_universal_checkpoint", "allreduce_gradients"),
        "DeepSpeedEngine",
    )
    missing += missing_attributes(get_accelerator(), ("is_fp16_supported",), "accelerator")
    marked, plain = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    mark_tensor_parallel(marked)
    if not is_tensor_parallel(marked) or is_tensor_parallel(plain):
        missing.append("is_model_parallel_parameter() reading the tensor_model_parallel mark")
    parsed = _parse_ds_to_universal("input", "output")
    if isinstance(parsed, str):
        missing.append(parsed)
    return missing


def check_engine(engine: Any) -> None:
    """Stop with IncompatibleLibraryError unless `engine` (from deepspeed.initialize) has every
    attribute llmstack reads or sets on an engine and its optimizer."""
    missing = missing_attributes(engine, ENGINE_ATTRIBUTES + ENGINE_PLAIN_ATTRIBUTES, "DeepSpeedEngine")
    if not missing:
        missing += missing_attributes(engine._config, ("load_universal_checkpoint",), "DeepSpeedConfig")
        if not isinstance(engine.enable_backward_allreduce, bool):
            missing.append("DeepSpeedEngine.enable_backward_allreduce as a bool")
        missing += _optimizer_problems(engine)
    SUPPORTED_DEEPSPEED.check(deepspeed.__version__, missing)


def _optimizer_problems(engine: Any) -> list[str]:
    optimizer = engine.optimizer
    label = type(optimizer).__name__
    missing = []
    if engine.fp16_enabled():
        missing += missing_attributes(optimizer, ("loss_scale",), label)
        if engine.dynamic_loss_scale() and _zero_class(optimizer) is not None:
            missing += missing_attributes(optimizer, ("loss_scaler",), label)
    zero_class = _zero_class(optimizer)
    if zero_class is not None:
        masters, gradients = ZERO_STATE_ATTRIBUTES[zero_class]
        missing += missing_attributes(optimizer, masters + gradients, label)
    return missing


# ---- checkpoints


def checkpoint_engine_base() -> type:
    """DeepSpeed's CheckpointEngine, the class an engine's checkpoint_engine must derive from."""
    return _internal("deepspeed.runtime.checkpoint_engine.checkpoint_engine", "CheckpointEngine")


def install_checkpoint_engine(engine: Any, checkpoint_engine: Any) -> None:
    """Make `engine` write and read every checkpoint file through `checkpoint_engine` (an instance
    of a checkpoint_engine_base() subclass) instead of the one DeepSpeed built at initialize."""
    if not isinstance(checkpoint_engine, checkpoint_engine_base()):
        raise TypeError(f"{type(checkpoint_engine).__name__} does not derive from DeepSpeed's CheckpointEngine")
    _attribute(engine, "checkpoint_engine")
    engine.checkpoint_engine = checkpoint_engine


@contextlib.contextmanager
def universal_checkpoint_loading(engine: Any) -> Iterator[None]:
    """Within the block engine.load_checkpoint reads DeepSpeed universal checkpoints. DeepSpeed
    takes this from its config (`checkpoint.load_universal`), fixed at initialize and read only
    while loading, so the config's flag is switched on for the block alone."""
    config = _attribute(engine, "_config")
    previous = _attribute(config, "load_universal_checkpoint")
    config.load_universal_checkpoint = True
    try:
        if engine.load_universal_checkpoint() is not True:
            raise _incompatible(
                "DeepSpeedEngine.load_universal_checkpoint() following DeepSpeedConfig.load_universal_checkpoint"
            )
        yield
    finally:
        config.load_universal_checkpoint = previous


def ds_to_universal_args(input_folder: str, output_folder: str) -> argparse.Namespace:
    """The arguments of ds_to_universal's `main` for converting `input_folder` (one checkpoint tag
    directory) into `output_folder` with one worker, parsed by its own command-line parser so
    every option gets DeepSpeed's default."""
    parsed = _parse_ds_to_universal(input_folder, output_folder)
    if isinstance(parsed, str):
        raise _incompatible(parsed)
    return parsed


def _parse_ds_to_universal(input_folder: str, output_folder: str) -> argparse.Namespace | str:
    """ds_to_universal's parse_arguments() on llmstack's options, or what its parser said about them."""
    options = [
        "--input_folder",
        str(input_folder),
        "--output_folder",
        str(output_folder),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    parse = _internal("deepspeed.checkpoint.ds_to_universal", "parse_arguments")
    saved_argv, sys.argv = sys.argv, ["ds_to_universal", *options]
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            return parse()
    except SystemExit:
        return f"ds_to_universal options {' '.join(options[::2])} ({output.getvalue().strip()})"
    finally:
        sys.argv = saved_argv


def convert_to_universal(input_folder: str, output_folder: str) -> None:
    """Run DeepSpeed's ds_to_universal on one checkpoint tag directory, in this process (it loads
    with torch.load: wrap the call in llmstack.safe_load.safe_loading)."""
    args = ds_to_universal_args(input_folder, output_folder)
    _internal("deepspeed.checkpoint.ds_to_universal", "main")(args)


def universal_checkpoint_info(
    replicated: list[str], row_parallel: list[str], pipeline_replicated: list[str]
) -> dict[str, Any]:
    """The `universal_checkpoint_info` entry a checkpoint is saved with, for ds_to_universal:
    parameter-name patterns (re.match) of the parameters replicated over the tensor-parallel
    ranks (taken from rank 0, not concatenated), of those split along dimension 1 (concatenated
    along it; the rest along dimension 0), and of those every pipeline stage holding them saves
    (taken from the first stage)."""
    key = functools.partial(_internal, "deepspeed.checkpoint.constants")
    return {
        key("UNIVERSAL_CHECKPOINT_VERSION_KEY"): 0.2,
        key("TP_REPLICATED_PARAMETER_PATTERNS"): replicated,
        key("PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"): row_parallel,
        key("PIPELINE_REPLICATED_PARAMETER_PATTERNS"): pipeline_replicated,
    }


def mark_universal_partition(param: torch.nn.Parameter, dim: int, sizes: list[int]) -> None:
    """Tell DeepSpeed's universal-checkpoint load which slice of the whole parameter `param` is:
    the tensor-parallel rank r holds `sizes[r]` rows along `dim` (uneven splits included; without
    this DeepSpeed assumes torch.chunk's split, which differs when the split is uneven)."""
    shape = list(full_shape(param))
    shape[dim] = sum(sizes)
    meta = {"partition_dim": dim, "logical_shape": tuple(shape), "partition_sizes": list(sizes)}
    setattr(param, _internal("deepspeed.checkpoint.constants", "DS_AUTOTP_UC_META"), meta)


def zero_to_fp32_state_dict(root: str, tag: str) -> dict:
    """{name: fp32 tensor} reassembled from the ZeRO shards of checkpoint `root/tag`."""
    consolidate = _internal("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint")
    return dict(consolidate(root, tag))


# Where ZeRO-3 records over which ranks each of its parameter sub-groups is partitioned (stage3.py,
# `_zero3_partition_group_metadata`), when some sub-group holds AutoEP-placed experts.
ZERO3_PARTITION_GROUPS = "ds_zero_partition_groups"


def zero3_replicated_state_dict(model_states: Mapping[str, Any], shards: Sequence[Mapping[str, Any]]) -> dict:
    """{name: fp32 tensor} of the parameters a ZeRO-3 checkpoint partitioned over all its data-parallel
    ranks, from one rank's model states and every data-parallel rank's optimizer shard (any order).
    The sub-groups partitioned over other groups (experts, over their expert-data-parallel groups)
    are left out. DeepSpeed's zero_to_fp32 takes every sub-group as partitioned over all ranks, and
    fails on a checkpoint with such experts. As there, each partition of a parameter holds
    ceil(numel / ranks) elements of it, the last one padded."""
    constant = functools.partial(_internal, "deepspeed.checkpoint.constants")
    states = [shard[constant("OPTIMIZER_STATE_DICT")] for shard in shards]
    if any(ZERO3_PARTITION_GROUPS not in state for state in states):
        raise _incompatible(f"ZeRO-3 optimizer shards recording {ZERO3_PARTITION_GROUPS}")
    whole = {}
    for i, shapes in enumerate(model_states[constant("PARAM_SHAPES")]):
        if states[0][ZERO3_PARTITION_GROUPS][i]["families"] != ["replicated"]:
            continue
        by_rank = {state[ZERO3_PARTITION_GROUPS][i]["partition_rank"]: state for state in states}
        if sorted(by_rank) != list(range(len(states))):
            raise _incompatible(f"ZeRO-3 sub-group {i} partitioned over every data-parallel rank")
        flats = [by_rank[rank][constant("FP32_FLAT_GROUPS")][i] for rank in range(len(states))]
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            size = math.ceil(numel / len(flats))
            whole[name] = torch.cat([flat[offset : offset + size] for flat in flats])[:numel].view(shape).clone()
            offset += size
    return whole


def checkpoint_state_classes() -> list[type]:
    """Non-container classes DeepSpeed pickles into its checkpoints; plain data, safe to rebuild
    under torch.load(weights_only=True)."""
    return [
        _internal("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        _internal("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        _internal("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        _internal("deepspeed.utils.tensor_fragment", "fragment_address"),
    ]


# DeepSpeed's checkpoint file names, in a tag directory:
#   mp_rank_{mp:02d}_model_states.pt                        engine module state (ZeRO 0-2), per model-parallel rank
#                                                           (a pipeline stage's with MoE layers: mp = stage x tp + t)
#   layer_{layer:02d}-model_{tp:02d}-model_states.pt        pipeline engine module state, per layer and tensor rank
#   zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt     ZeRO-3 engine module state (partitioned parameters
#                                                           empty), per data- and model-parallel rank
#   [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   ZeRO optimizer shard, per data- and model-parallel rank
MODEL_STATES_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
PARTITIONED_MODEL_STATES_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
LAYER_STATES_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
ZERO_SHARD_FILE = re.compile(r"(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


@dataclass
class CheckpointFiles:
    """The files of one DeepSpeed checkpoint tag directory, by the ranks in their names."""

    model_states: dict[int, Path] = field(default_factory=dict)  # model-parallel rank -> file
    layer_states: dict[tuple[int, int], Path] = field(default_factory=dict)  # (layer, tensor rank) -> file
    zero_shards: dict[tuple[int, int], Path] = field(default_factory=dict)  # (data rank, model rank) -> file
    partitioned_model_states: dict[tuple[int, int], Path] = field(default_factory=dict)  # ZeRO-3's, the same keys

    def zero_layout(self) -> tuple[int, int]:
        """(data-parallel size, model-parallel size) of the ZeRO shards; (0, 0) without ZeRO shards
        (stage 0), which load on any number of ranks."""
        return len({dp for dp, _ in self.zero_shards}), len({mp for _, mp in self.zero_shards})


def saved_tensor_parallel_size(model_states: dict[str, Any]) -> int:
    """The tensor-parallel size recorded in a loaded model-states file (its parallel dimensions)."""
    key = functools.partial(_internal, "deepspeed.checkpoint.constants")
    dims = model_states.get(key("CHECKPOINT_PARALLEL_DIMS"), {})
    if key("CHECKPOINT_TP_DEGREE") not in dims:
        raise _incompatible("a model-states file recording its tensor-parallel size")
    return int(dims[key("CHECKPOINT_TP_DEGREE")])


def checkpoint_files(tag_dir: str | Path) -> CheckpointFiles:
    """Sort the files of checkpoint directory `tag_dir` by DeepSpeed's naming."""
    files = CheckpointFiles()
    for path in Path(tag_dir).iterdir():
        if match := MODEL_STATES_FILE.fullmatch(path.name):
            files.model_states[int(match[1])] = path
        elif match := LAYER_STATES_FILE.fullmatch(path.name):
            files.layer_states[int(match[1]), int(match[2])] = path
        elif match := ZERO_SHARD_FILE.fullmatch(path.name):
            files.zero_shards[int(match[1]), int(match[2])] = path
        elif match := PARTITIONED_MODEL_STATES_FILE.fullmatch(path.name):
            files.partitioned_model_states[int(match[1]), int(match[2])] = path
    return files


# ---- gradients and optimizer state


def disable_backward_allreduce(engine: Any) -> None:
    """Stop `engine` all-reducing gradients after backward, for an optimizer that communicates by
    itself. DeepSpeed does so at ZeRO stage 0 unless the engine's `enable_backward_allreduce` is
    False (the switch its pipeline engine and its removed 1-bit optimizers used)."""
    if not isinstance(_attribute(engine, "enable_backward_allreduce"), bool):
        raise _incompatible("DeepSpeedEngine.enable_backward_allreduce as a bool")
    engine.enable_backward_allreduce = False


# What replace_gradient_reduction patches: at stage 0 the engine's fallback all-reduce of every
# gradient (called at each accumulation boundary), at ZeRO 1/2 the optimizer's all-reduce of one
# contiguous gradient bucket (reached when zero_optimization.reduce_scatter is false), and what each
# reads to know which parameters a bucket holds.
STAGE0_REDUCTION_ATTRIBUTES = ("buffered_allreduce_fallback", "module")
ZERO_REDUCTION_ATTRIBUTES = (
    "gradient_reduction_w_predivide",
    "ipg_buckets",
    "bit16_groups",
    "dp_process_group",
    "reduce_scatter",
    "contiguous_gradients",
)
# GradientAverage(flat bucket, parameter keys, their numels, process group) averages in place.
GradientAverage = Callable[[torch.Tensor, list, list, Any], None]


def replace_gradient_reduction(engine: Any, average: GradientAverage) -> None:
    """Make `engine` average its data-parallel gradients with `average` instead of DeepSpeed's
    all-reduce (stage 0) or bucket reduction (ZeRO 1 and 2, built with reduce_scatter false,
    contiguous_gradients true). Keys name parameters the same way at every
    step (their index in the model at stage 0, DeepSpeed's parameter id at ZeRO 1/2). Raises
    IncompatibleLibraryError when what it patches is not where it was."""
    optimizer = engine.optimizer
    zero_class = _zero_class(optimizer)
    if zero_class == ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"):
        missing = missing_attributes(optimizer, ZERO_REDUCTION_ATTRIBUTES, type(optimizer).__name__)
        if missing:
            raise _incompatible(", ".join(missing))
        if optimizer.reduce_scatter or not optimizer.contiguous_gradients:
            raise ValueError("ZeRO 1/2 must be built with reduce_scatter false and contiguous_gradients true")
        optimizer.gradient_reduction_w_predivide = functools.partial(_average_zero_bucket, optimizer, average)
        return
    if zero_class is not None or isinstance(optimizer, _internal("deepspeed.runtime.base_optimizer", "ZeROOptimizer")):
        raise ValueError(f"gradient compression runs at ZeRO stages 0, 1 and 2, not with {type(optimizer).__name__}")
    replace_stage0_allreduce(engine, functools.partial(_average_all_gradients, engine, average))


def replace_stage0_allreduce(engine: Any, reduce_all: Callable[..., None]) -> None:
    """Make a ZeRO stage 0 engine call `reduce_all(grads=None, elements_per_buffer=N)` where it
    would all-reduce every gradient: at the end of each accumulation step's last backward."""
    missing = missing_attributes(engine, STAGE0_REDUCTION_ATTRIBUTES, "DeepSpeedEngine")
    if missing:
        raise _incompatible(", ".join(missing))
    engine.buffered_allreduce_fallback = reduce_all


def data_parallel_group() -> Any:
    """The data-parallel process group DeepSpeed's engine all-reduces gradients over."""
    return _internal("deepspeed.utils.groups", "_get_data_parallel_group")()


def _average_zero_bucket(optimizer: Any, average: GradientAverage, tensor: torch.Tensor, comm_dtype: Any) -> Any:
    """DeepSpeedZeroOptimizer.gradient_reduction_w_predivide: the bucket averaged in place."""
    if tensor.numel() == 0:
        return tensor
    params = [
        (param_id, optimizer.bit16_groups[i][j].numel()) for i, j, param_id in optimizer.ipg_buckets[comm_dtype].params
    ]
    average(tensor, [key for key, _ in params], [numel for _, numel in params], optimizer.dp_process_group)
    return tensor


def _average_all_gradients(
    engine: Any, average: GradientAverage, grads: Any = None, elements_per_buffer: int = 0
) -> None:
    """DeepSpeedEngine.buffered_allreduce_fallback: every gradient averaged as one flat bucket,
    a missing one as zeros (as DeepSpeed does, so that every rank sends the same layout)."""
    indexed = [(i, p) for i, p in enumerate(engine.module.parameters()) if p.requires_grad and p.numel()]
    for _, p in indexed:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad.data for _, p in indexed]
    flat = torch.cat([g.reshape(-1) for g in grads])
    average(
        flat,
        [i for i, _ in indexed],
        [g.numel() for g in grads],
        data_parallel_group(),
    )
    for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(averaged.view_as(grad))


def zero_state_tensors(optimizer: Any) -> tuple[list, list]:
    """(fp32 master partitions, gradient partitions) a ZeRO optimizer holds besides its param
    groups and `.grad`s, as DeepSpeed stores them (lists, dicts, tensors); ([], []) for an
    optimizer that is not one of DeepSpeed's ZeRO optimizers."""
    zero_class = _zero_class(optimizer)
    if zero_class is None:
        if isinstance(optimizer, _internal("deepspeed.runtime.base_optimizer", "ZeROOptimizer")):
            raise _incompatible(f"a known place for the master weights of ZeRO optimizer {type(optimizer).__name__}")
        return [], []
    masters, gradients = ZERO_STATE_ATTRIBUTES[zero_class]
    return [_attribute(optimizer, n) for n in masters], [_attribute(optimizer, n) for n in gradients]


def zero3_parameter_partitions(optimizer: Any, params: list) -> list:
    """This rank's partitions (`param.ds_tensor`) of `params` under a ZeRO-3 optimizer; [] otherwise."""
    if _zero_class(optimizer) != ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"):
        return []
    return [_attribute(p, "ds_tensor") for p in params]


def _zero_class(optimizer: Any) -> tuple[str, str] | None:
    """The ZERO_STATE_ATTRIBUTES key (module, class name) of `optimizer`'s class, if it has one."""
    for module, name in ZERO_STATE_ATTRIBUTES:
        if isinstance(optimizer, _internal(module, name)):
            return module, name
    return None


# ---- fp16 loss scaling


def loss_scale(engine: Any) -> float:
    """The fp16 optimizer's current loss scale."""
    return float(_attribute(engine.optimizer, "loss_scale"))


def skipped_steps(engine: Any) -> int:
    """Optimizer steps the engine skipped (fp16 overflow) since training began."""
    return int(_attribute(engine, "skipped_steps"))


def min_loss_scale(engine: Any) -> float:
    """The dynamic loss scale's floor (`fp16.min_loss_scale`)."""
    return engine.dynamic_loss_scale_args()[_internal("deepspeed.runtime.fp16.loss_scaler", "MIN_LOSS_SCALE")]


def leave_min_loss_scale_to_caller(engine: Any) -> None:
    """ZeRO's DynamicLossScaler raises a bare Exception on its first overflow at the minimum
    scale (stage 0's fp16 optimizer skips steps instead): switch that off, so the caller decides
    the same way at every stage. A no-op without a ZeRO optimizer with dynamic loss scaling."""
    if _zero_class(engine.optimizer) is None or not engine.dynamic_loss_scale():
        return
    scaler = _attribute(engine.optimizer, "loss_scaler")
    if not isinstance(scaler, _internal("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")):
        raise _incompatible(f"a DynamicLossScaler as {type(engine.optimizer).__name__}.loss_scaler")
    _attribute(scaler, "raise_error_at_min_scale")
    scaler.raise_error_at_min_scale = False


# DeepSpeed's stage-0 fp16/bf16 wrappers (FP16_Optimizer around its fused Adam, FP16_UnfusedOptimizer
# around any other) create their optimizer's state by stepping it once on zero gradients. Adam counts
# that step, so the first real update is bias-corrected as the second (0.744 of the learning rate at
# betas 0.9/0.999 instead of 1), and AdamW decays the master weights once before training. ZeRO 1-3
# create their state without a step (DeepSpeed PR #5104 removed it there).
STAGE0_LOW_PRECISION_OPTIMIZERS = (
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
)


@contextlib.contextmanager
def stateless_optimizer_initialization() -> Iterator[None]:
    """Within the block, DeepSpeed's stage-0 fp16/bf16 optimizers are built without stepping: their
    state-creating step runs at learning rate and weight decay 0, and the optimizer's state is put
    back as it was, so the first real step creates it as a plain optimizer's does (Adam's first
    update is lr)."""
    classes = [_internal(module, name) for module, name in STAGE0_LOW_PRECISION_OPTIMIZERS]
    originals = [_attribute(cls, "initialize_optimizer_states") for cls in classes]

    def without_a_step(initialize: Any) -> Any:
        @functools.wraps(initialize)
        def wrapper(self: Any) -> None:
            optimizer = _attribute(self, "optimizer")
            # The state before (empty for Adam, which creates it lazily; llmstack's 1-bit Adam's step count).
            state = copy.deepcopy(dict(optimizer.state))
            saved = [
                {key: group[key] for key in ("lr", "weight_decay") if key in group} for group in optimizer.param_groups
            ]
            for group, values in zip(optimizer.param_groups, saved):
                group.update(dict.fromkeys(values, 0.0))
            try:
                initialize(self)
            finally:
                for group, values in zip(optimizer.param_groups, saved):
                    group.update(values)
                optimizer.state.clear()
                optimizer.state.update(state)

        return wrapper

    for cls, original in zip(classes, originals):
        cls.initialize_optimizer_states = without_a_step(original)
    try:
        yield
    finally:
        for cls, original in zip(classes, originals):
            cls.initialize_optimizer_states = original


def enable_fp16_on_cpu() -> None:
    """Test harness only: let DeepSpeed's CPU accelerator run its real fp16 optimizers and loss
    scaler. The CPU accelerator reports fp16 as unsupported, and `deepspeed.initialize` refuses it."""
    accelerator = get_accelerator()
    _attribute(accelerator, "is_fp16_supported")
    accelerator.is_fp16_supported = lambda: True


# ---- parallelism and random streams


def rng_tracker() -> Any:
    """DeepSpeed's RNG tracker (named random streams that its activation checkpointing saves and
    restores around a recomputation)."""
    return _internal(
        "deepspeed.runtime.activation_checkpointing.checkpointing",
        "get_cuda_rng_tracker",
    )()


def pipe_data_parallel_topology(pipeline: int, tensor: int, data: int) -> Any:
    """DeepSpeed's 3D process layout (axes pipe, data, model) that its PipelineModule and mpu use."""
    return _internal("deepspeed.runtime.pipe.topology", "PipeModelDataParallelTopology")(
        num_pp=pipeline, num_mp=tensor, num_dp=data
    )


def split_pipeline_state_key(name: str) -> tuple[int | str, str]:
    """(layer index, or the tie key of a tied layer; the name within that layer) of a key of a
    PipelineModule's state dict, where DeepSpeed names layer i's entries `i.<name>` and a tied
    layer's `tied_modules.<tie key>.<name>`."""
    prefix, rest = name.split(".", 1)
    if prefix == "tied_modules":
        tie_key, rest = rest.split(".", 1)
        return tie_key, rest
    return int(prefix), rest


def pipeline_stage(pipe: Any) -> tuple[int, int]:
    """(this rank's stage, number of stages) of a PipelineModule."""
    return int(_attribute(pipe, "stage_id")), int(_attribute(pipe, "num_stages"))


def wrap_last_pipeline_layer(pipe: Any, wrap: Any) -> None:
    """Run `wrap(f)` in place of f, the last layer this stage of a PipelineModule runs (its
    `forward_funcs`); DeepSpeed saves and loads a layer through the same entry, so `wrap(f)` must
    pass `state_dict`/`load_state_dict` on to f."""
    layers = _attribute(pipe, "forward_funcs")
    layers[-1] = wrap(layers[-1])


def mark_tensor_parallel(param: torch.nn.Parameter) -> None:
    """Mark `param` as split across the tensor-parallel ranks (Megatron's `tensor_model_parallel`
    attribute): DeepSpeed's gradient norm then sums it over the model-parallel group, where it
    counts replicated parameters once."""
    param.tensor_model_parallel = True  # type: ignore[attr-defined]


def is_zero3_partitioned(param: torch.nn.Parameter) -> bool:
    """Whether ZeRO-3 partitions `param` (it then has a `ds_id`)."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """The shape the model gives `param`: ZeRO-3 replaces a parameter it partitions (one that has a
    `ds_id`) by a 1-D placeholder and keeps the shape in the undocumented `ds_shape`."""
    return _attribute(param, "ds_shape") if is_zero3_partitioned(param) else param.shape


def write_zero3_partition(param: torch.nn.Parameter, whole: torch.Tensor) -> None:
    """Copy this rank's ZeRO-3 partition of `whole` (a value of the full shape of `param`, which
    zero.Init partitioned) into the partition, without communication. DeepSpeed (0.19.8,
    partition_parameters.py) keeps in `ds_tensor` the elements [rank * n, (rank + 1) * n) of the
    flattened parameter, n = ds_tensor.ds_numel, the last partition padded."""
    partition = _attribute(param, "ds_tensor")
    size = _attribute(partition, "ds_numel")
    start = size * torch.distributed.get_rank(group=_attribute(param, "ds_process_group"))
    piece = whole.detach().reshape(-1)[start : start + size]
    partition.data[: piece.numel()].copy_(piece)


@contextlib.contextmanager
def whole_on_this_rank(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Within the block each ZeRO-3-partitioned parameter of `params` holds an uninitialised
    tensor of its full shape, on this rank alone (no communication); leaving it, the rank keeps
    its partition of what the block wrote (every rank must write the same) and frees the rest.
    Unlike deepspeed.zero.GatheredParameters, nothing is gathered: on gloo an all-gather holds
    the whole parameter twice."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    for param in partitioned:
        partition = _attribute(param, "ds_tensor")
        param.data = torch.empty(full_shape(param), dtype=partition.dtype, device=partition.device)
    try:
        yield
    finally:
        for param in partitioned:
            write_zero3_partition(param, param.data)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def is_tensor_parallel(param: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed counts `param` as split across the model-parallel ranks."""
    return bool(_internal("deepspeed.runtime.utils", "is_model_parallel_parameter")(param))


# ---- expert parallelism: DeepSpeed's MoE machinery for llmstack's own MoE blocks
#
# DeepSpeed reduces and partitions expert parameters (those marked `allreduce = False` with a
# `group_name`, deepspeed.moe.utils.is_moe_param) over the expert-data-parallel group only when the
# engine `has_moe_layers`, which it decides by `isinstance(module, deepspeed.moe.layer.MoE)` while
# it is built, and it finds the groups by name in deepspeed.utils.groups. The three functions below
# give it llmstack's blocks and groups; `check_moe_engine` verifies that the engine took them.


def register_expert_groups(name: str, expert_parallel_group: Any, expert_data_parallel_group: Any) -> None:
    """Record this rank's expert-parallel and expert-data-parallel groups in DeepSpeed's registry
    under `name` (the expert parameters' `group_name`, "ep_size_N"), where its engine, ZeRO and
    checkpointing look them up; DeepSpeed's own MoE layer creates them there itself."""
    get = functools.partial(_internal, "deepspeed.utils.groups")
    for groups, ranks, group in (
        ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", expert_parallel_group),
        ("_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS", expert_data_parallel_group),
    ):
        get(groups)[name] = group
        get(ranks)[name] = torch.distributed.get_process_group_ranks(group)
    if get("_get_expert_parallel_rank")(name) != torch.distributed.get_rank(expert_parallel_group):
        raise _incompatible("deepspeed.utils.groups reading expert groups from its registry")


@contextlib.contextmanager
def counted_as_moe_layers(block_class: type) -> Iterator[None]:
    """Within the block, a DeepSpeedEngine being built (deepspeed.initialize) counts modules of
    `block_class` (which must have `num_experts`) as MoE layers, as it counts its own MoE class."""
    engine_module: Any = importlib.import_module("deepspeed.runtime.engine")
    own = _internal("deepspeed.runtime.engine", "MoE")
    engine_module.MoE = (own, block_class)  # isinstance accepts a tuple
    try:
        yield
    finally:
        engine_module.MoE = own


def mark_expert_parameter(param: torch.nn.Parameter, group_name: str) -> None:
    """Mark `param` as one of this rank's experts, of the expert groups registered as `group_name`:
    DeepSpeed then reduces its gradient over the expert-data-parallel group only (`allreduce`,
    `group_name`, as deepspeed.moe.utils.is_moe_param reads), and ZeRO-3 partitions it over that
    group, sums its gradient norm over the expert-parallel group and divides its gradient by the
    data-parallel size (the placement its AutoEP layers give their experts, auto_ep_layer.py)."""
    param.allreduce = False  # type: ignore[attr-defined]
    param.group_name = group_name  # type: ignore[attr-defined]
    param.ds_zero_placement_family = "autoep_expert"  # type: ignore[attr-defined]
    param.ds_zero_partition_group_name = group_name  # type: ignore[attr-defined]


@contextlib.contextmanager
def counted_as_autoep_layers(block_class: type) -> Iterator[None]:
    """Within the block, a DeepSpeedEngine being built at ZeRO stage 3 counts modules of
    `block_class` (which must have `num_experts`, and experts marked by mark_expert_parameter) as
    its AutoEP layers: ZeRO-3 refuses every other MoE layer (`_validate_zero3_moe_compatibility`).
    The engine also hands each AutoEP layer its expert groups (`set_deepspeed_parallelism`);
    llmstack's blocks got theirs from expert_parallelize, so the class answers that with nothing
    within the block."""
    layer_module: Any = importlib.import_module("deepspeed.module_inject.auto_ep_layer")
    own = _internal("deepspeed.module_inject.auto_ep_layer", "AutoEPMoELayer")
    engine_class = _internal("deepspeed.runtime.engine", "DeepSpeedEngine")
    for name in ("_validate_zero3_moe_compatibility", "_resolve_zero3_param_placement"):
        _attribute(engine_class, name)
    bind = _attribute(own, "set_deepspeed_parallelism")
    if "folding_group_handles" not in inspect.signature(bind).parameters:
        raise _incompatible("AutoEPMoELayer.set_deepspeed_parallelism(..., folding_group_handles=...)")
    if hasattr(block_class, "set_deepspeed_parallelism"):
        raise TypeError(f"{block_class.__name__} already has set_deepspeed_parallelism")
    layer_module.AutoEPMoELayer = (own, block_class)  # isinstance accepts a tuple
    block_class.set_deepspeed_parallelism = _groups_already_bound  # type: ignore[attr-defined]
    try:
        yield
    finally:
        layer_module.AutoEPMoELayer = own
        del block_class.set_deepspeed_parallelism  # type: ignore[attr-defined]


def _groups_already_bound(self: Any, *args: Any, **kwargs: Any) -> None:
    """An llmstack MoE block's answer to the engine handing it its expert groups: it has them."""


def moe_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`param_groups` (each with a unique "name") with the expert parameters moved into groups of
    their own, marked "moe" and named by their expert group, which ZeRO partitions over the
    expert-data-parallel group (what DeepSpeed does for its own MoE layers)."""
    split = _internal("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer")
    return split([dict(group) for group in param_groups])


def check_moe_engine(engine: Any, expert_data_parallel_group: Any = None) -> None:
    """Stop with IncompatibleLibraryError unless `engine` (built under counted_as_moe_layers, or
    counted_as_autoep_layers at ZeRO stage 3) treats the model as an MoE model: `has_moe_layers`, a
    ZeRO-1/2 optimizer with expert groups, a ZeRO-3 one with every expert partitioned over
    `expert_data_parallel_group`."""
    missing = []
    if _attribute(engine, "has_moe_layers") is not True:
        missing.append("DeepSpeedEngine.has_moe_layers set by counted_as_moe_layers")
    optimizer = engine.optimizer
    zero_class = _zero_class(optimizer)
    if zero_class == ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"):
        if True not in getattr(optimizer, "is_moe_param_group", []):
            missing.append("DeepSpeedZeroOptimizer.is_moe_param_group marking the expert groups")
    if zero_class == ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"):
        expected = torch.distributed.get_process_group_ranks(expert_data_parallel_group)
        experts = [p for p in engine.module.parameters() if getattr(p, "allreduce", True) is False]
        ranks = torch.distributed.get_process_group_ranks
        if not experts or any(ranks(_attribute(p, "ds_process_group")) != expected for p in experts):
            missing.append("ZeRO-3 partitioning the experts over their expert-data-parallel group (ds_process_group)")
    SUPPORTED_DEEPSPEED.check(deepspeed.__version__, missing)


# ---- the CPU all-reduce's shared memory

# DeepSpeed's CPU all-reduce (ops/csrc/cpu/comm/shm.cpp, `shm_initialize`) gives each rank of a job
# whose ranks are all local one POSIX shared-memory file, named from the uid, MASTER_ADDR,
# MASTER_PORT and the rank, of about 66 MiB, and never removes it: every launch, even a clean one,
# leaves them in /dev/shm (RAM) until the machine restarts.
SHM_DIR = Path("/dev/shm")
ALLREDUCE_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def allreduce_buffer_name(rank: int) -> str:
    """The name of `rank`'s buffer in this job (from the launcher's environment)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{ALLREDUCE_BUFFER_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_allreduce_buffer(rank: int) -> None:
    """Remove `rank`'s buffer from /dev/shm once every rank of the job has mapped every buffer (the
    names are read only in `shm_initialize`). The mappings stay valid; the kernel frees the memory
    when the last process of the job exits, however it exits (SIGKILL too)."""
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / allreduce_buffer_name(rank)).unlink()


def remove_stale_allreduce_buffers() -> list[str]:
    """Remove this user's buffers that no live process holds open or mapped: those of jobs that
    ended before their ranks removed them (killed during start-up, or run without llmstack).
    Returns the names removed. A live job's buffers are never touched: DeepSpeed keeps each file's
    descriptor open for the life of the process that created it, from the moment it exists."""
    prefix = f"{ALLREDUCE_BUFFER_PREFIX}_{os.getuid()}_"
    try:
        candidates = [p for p in SHM_DIR.iterdir() if p.name.startswith(prefix)]  # before the scan below
    except OSError:
        return []
    if not candidates:
        return []
    in_use = _shm_files_in_use()
    removed = []
    for path in candidates:
        if path.name in in_use:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed


def _shm_files_in_use() -> set[str]:
    """Names of /dev/shm files that some process this user can inspect has open or mapped."""
    names: set[str] = set()
    shm = str(SHM_DIR) + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(shm):
                        names.add(target[len(shm) :].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith(shm):
                    names.add(path[0][len(shm) :].removesuffix(" (deleted)"))
    return names


# ---- what this machine can build


def op_report() -> dict[str, list[str]]:
    """{"prebuilt", "buildable", "not buildable": DeepSpeed op names}. An op whose builder's probe
    fails (a CUDA builder without the CUDA toolkit raises) counts as not buildable."""
    all_ops = _internal("deepspeed.ops.op_builder.all_ops", "ALL_OPS")
    installed = _internal("deepspeed.git_version_info", "installed_ops")
    buildable = sorted(name for name, builder in all_ops.items() if _buildable(builder))
    return {
        "prebuilt": sorted(name for name, built in installed.items() if built),
        "buildable": buildable,
        "not buildable": sorted(set(all_ops) - set(buildable)),
    }


def _buildable(builder: Any) -> bool:
    try:
        return bool(builder.is_compatible(False))
    except Exception:  # noqa: BLE001  (a failing probe means the op cannot be built here)
        return False


check_installed()


def zero_model_states_estimate(
    stage: int, total_params: int, largest_layer_params: int, gpus: int, offload: str = "none"
) -> int | None:
    """DeepSpeed's own estimate of the model states' bytes per GPU (what its
    estimate_zero{2,3}_model_states_mem_needs_all_live print as "per GPU") for ZeRO-2 and ZeRO-3,
    `offload` "none", "optimizer" or "optimizer+params" (ZeRO-3); None for other stages."""
    if stage == 2 and offload in ("none", "optimizer"):
        estimate = _internal("deepspeed.runtime.zero.stage_1_and_2", "estimate_zero2_model_states_mem_needs")
        return int(estimate(total_params, num_gpus_per_node=gpus, cpu_offload=offload != "none")[1])
    if stage == 3:
        estimate = _internal("deepspeed.runtime.zero.stage3", "estimate_zero3_model_states_mem_needs")
        cpu_offload, cpu_offload_params = offload != "none", offload == "optimizer+params"
        return int(
            estimate(
                total_params,
                largest_layer_params,
                num_gpus_per_node=gpus,
                cpu_offload=cpu_offload,
                cpu_offload_params=cpu_offload_params,
            )[1]
        )
    return None
