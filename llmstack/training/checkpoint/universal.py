"""DeepSpeed's universal checkpoint: every parameter whole, with its optimizer state, one folder each
(`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), whatever the ZeRO stage and the data-, tensor-
and pipeline-parallel sizes that saved it. llmstack uses it to resume on another layout.

The conversion is DeepSpeed's `ds_to_universal`, run in this process with safe loading. It reads
how each parameter was split from the `universal_checkpoint_info` entry that CheckpointManager
saves with every checkpoint (`universal_checkpoint_info` below: which parameters are replicated
over the tensor-parallel ranks, which are split along dimension 1, which every pipeline stage
holding them saves). The converted folders are then renamed to the plain model's names (a
pipeline's `3.layer.mlp...` become `model.layers.2.mlp...`), and a pipeline that loads them finds
them under its own names through links. Loading, each split parameter is told its rank's slice
(`mark_universal_partition`), uneven splits included.
"""

import contextlib
import io
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmstack.compat.deepspeed import (
    checkpoint_files,
    mark_universal_partition,
    universal_checkpoint_loading,
)
from llmstack.compat.deepspeed import convert_to_universal as ds_to_universal
from llmstack.compat.deepspeed import universal_checkpoint_info as ds_universal_checkpoint_info
from llmstack.errors import UserError
from llmstack.parallel.checkpoint import (
    is_pipeline_name,
    pipeline_tied_names,
    plain_names,
    tensor_parallel_partitions,
)
from llmstack.parallel.pipeline import plain_pipeline_name
from llmstack.safe_load import safe_loading


def saved_layout(tag_dir: str) -> tuple[int, int]:
    """(data-parallel size, model-parallel size) of the ZeRO shards in `tag_dir`; (0, 0) for a
    checkpoint without ZeRO shards (stage 0), which loads on any number of ranks."""
    return checkpoint_files(tag_dir).zero_layout()


def saved_weights_partitioned(tag_dir: str) -> bool:
    """Whether ZeRO-3 partitioned the weights of checkpoint `tag_dir` (its model states per data-parallel rank)."""
    return bool(checkpoint_files(tag_dir).partitioned_model_states)


def universal_checkpoint_info(module: nn.Module, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Collective over `group` (every rank): the `universal_checkpoint_info` to save with each
    checkpoint of the engine module `module` (plain, tensor-parallel or a pipeline stage)."""
    split = {name: dim for name, (dim, _) in tensor_parallel_partitions(module).items()}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (list(plain_names(module)), split, pipeline_tied_names(module)), group=group)
    names = {name for rank_names, _, _ in everyone for name in rank_names}
    split = {name: dim for _, rank_split, _ in everyone for name, dim in rank_split.items()}
    tied = {name for _, _, rank_tied in everyone for name in rank_tied}
    return ds_universal_checkpoint_info(
        replicated=[_exactly(n) for n in sorted(names - set(split))] if split else [],
        row_parallel=[_exactly(n) for n, dim in sorted(split.items()) if dim == 1],
        pipeline_replicated=[_exactly(n) for n in sorted(tied)],
    )


def _exactly(name: str) -> str:
    return re.escape(name) + "$"


def convert_to_universal(tag_dir: str, out_dir: str, num_hidden_layers: int) -> None:
    """Write the universal form of checkpoint `tag_dir` to `out_dir`, under the plain model's
    parameter names."""
    log = io.StringIO()
    try:
        with safe_loading(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal(tag_dir, out_dir)
    except Exception as e:
        raise UserError(
            f"could not convert checkpoint {tag_dir} to DeepSpeed's universal format: {e}\n{log.getvalue()[-2000:]}"
        ) from e
    zero = os.path.join(out_dir, "zero")
    for name in os.listdir(zero):
        if is_pipeline_name(name):
            os.rename(os.path.join(zero, name), os.path.join(zero, plain_pipeline_name(name, num_hidden_layers)))


def link_module_names(out_dir: str, module: nn.Module) -> None:
    """Make the universal checkpoint in `out_dir` (plain names) readable under `module`'s own
    parameter names (a pipeline stage's): each rank links the folders of its parameters."""
    zero = os.path.join(out_dir, "zero")
    for name, plain in plain_names(module).items():
        if name != plain:
            with contextlib.suppress(FileExistsError):  # another tensor-parallel rank of the stage did
                os.symlink(plain, os.path.join(zero, name))


@contextlib.contextmanager
def loading_universal(engine: Any) -> Iterator[None]:
    """Within the block, engine.load_checkpoint reads universal checkpoints. DeepSpeed takes this
    from its config (`checkpoint.load_universal`), which is fixed at initialize; it is only read
    while loading, so it is switched on for the load alone.

    DeepSpeed's ZeRO-3 universal load also gives every parameter group the first group's
    hyperparameters, weight decay included (DeepSpeed 0.19.8, stage3.py); the run's own are put
    back afterwards, and each group's learning rate is the one the checkpoint's schedule last set
    for it (groups differ under µP: llmstack.models.mup). It also gives
    every partition's optimizer state one and the same `step` object, which torch's AdamW
    increments in place, once per partition and step: each gets its own copy."""
    parameters = dict(engine.module.named_parameters(remove_duplicate=False))  # a tied lm_head too
    for name, (dim, sizes) in tensor_parallel_partitions(engine.module).items():
        mark_universal_partition(parameters[name], dim, sizes)
    hyperparameters = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in engine.optimizer.param_groups]
    with universal_checkpoint_loading(engine):
        yield
    groups = engine.optimizer.param_groups
    scheduler = getattr(engine, "lr_scheduler", None)  # loaded with the checkpoint
    lrs = scheduler.get_last_lr() if scheduler is not None else [g["lr"] for g in groups]
    for group, values, lr in zip(groups, hyperparameters, lrs):
        group.update(values, lr=lr)
    for state in engine.basic_optimizer.state.values():  # basic_optimizer: checked by compat at start-up
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
