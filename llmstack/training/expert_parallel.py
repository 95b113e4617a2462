"""Expert parallelism in the trainer (`train.expert_parallel_size`): what a run may combine it with,
and the DeepSpeed engine set up for it.

The model is built whole on every rank (same seed, same weights), then each rank keeps its
experts (llmstack.parallel.expert_parallel.expert_parallelize). DeepSpeed then treats the experts
as it treats those of its own MoE layer: their gradients are summed over the expert-data-parallel
group (the ranks holding the same experts) after the division by the data-parallel size that the
dense gradients get, so the update is the one of the whole model; under ZeRO-1/2 their optimizer
state is partitioned over that group; the gradient norm counts every expert once (ZeRO-1/2, bf16,
fp16). Only fp32 at ZeRO stage 0 clips by DeepSpeed's mean of per-rank norms, each missing the
other ranks' experts, so that combination is refused when clipping is on.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from llmstack.compat.deepspeed import counted_as_moe_layers, moe_param_groups, register_expert_groups
from llmstack.errors import UserError
from llmstack.models import LLMStackConfig
from llmstack.models.moe import MoEBlock
from llmstack.parallel import Topology
from llmstack.parallel.expert_parallel import expert_group_name

from .config import TrainConfig
from .ds_config import zero_stage


def check_expert_count(size: int, config: LLMStackConfig) -> None:
    """Refuse splitting the experts of `config` over `size` ranks unless they divide (the run config
    checks this before start-up unless the model comes from init_from)."""
    experts = getattr(config, "num_local_experts", 0)
    if size > 1 and (not experts or experts % size):
        raise UserError(
            f"train.expert_parallel_size {size} must divide the model's num_local_experts "
            f"({experts}): expert parallelism splits the experts of a mixture-of-experts model"
        )


def check_expert_parallel_engine(train: TrainConfig, ds_config: dict[str, Any]) -> None:
    """Refuse, before start-up, engine settings expert parallelism does not support."""
    if train.expert_parallel_size == 1:
        return
    if train.pipeline_parallel_size > 1:
        raise UserError(
            "expert parallelism does not combine with pipeline parallelism: set train.expert_parallel_size to 1 "
            "(mixture-of-experts models train with pipeline x tensor x data parallelism) or "
            "train.pipeline_parallel_size to 1"
        )
    stage = zero_stage(ds_config)
    if stage > 2:
        raise UserError(f"expert parallelism trains with ZeRO stage 0, 1 or 2, not {stage}: use ds_configs/zero2.json")
    if str((ds_config.get("optimizer") or {}).get("type", "")).lower() == "onebitadam":
        raise UserError(
            "OneBitAdam all-reduces every gradient over all data-parallel ranks: use AdamW with split experts"
        )
    mixed = any(ds_config.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
    if stage == 0 and not mixed and train.grad_clip > 0:
        raise UserError(
            "expert parallelism at ZeRO stage 0 in fp32 with gradient clipping: DeepSpeed clips there by the mean "
            "of the ranks' gradient norms, each missing the other ranks' experts. Use ZeRO stage 1 or 2 "
            "(ds_configs/zero1.json), or set train.grad_clip=0"
        )


def named_param_groups(param_groups: list[dict[str, Any]], topology: Topology) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, the experts in groups of their own when they are split."""
    named = [{"name": f"group{i}", **group} for i, group in enumerate(param_groups)]
    return moe_param_groups(named) if topology.expert_parallel_size > 1 else param_groups


@contextlib.contextmanager
def engine_with_experts(topology: Topology) -> Iterator[None]:
    """Build the DeepSpeed engine within this block: with experts split, DeepSpeed sees the MoE
    blocks and the expert groups (see llmstack.compat.deepspeed)."""
    if topology.expert_parallel_size == 1:
        yield
        return
    register_expert_groups(
        expert_group_name(topology.expert_parallel_size),
        topology.expert_parallel_group,
        topology.expert_data_parallel_group,
    )
    with counted_as_moe_layers(MoEBlock):
        yield
