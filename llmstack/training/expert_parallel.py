"""Expert parallelism in the trainer (`train.expert_parallel_size`): the DeepSpeed engine set up for
it (what a run may combine it with is llmstack.parallel.layout's table).

The model is built whole on every rank (same seed, same weights), then each rank keeps its
experts (llmstack.parallel.expert_parallel.expert_parallelize). DeepSpeed then treats the experts
as it treats those of its own MoE layer: their gradients are summed over the expert-data-parallel
group (the ranks holding the same experts) after the division by the data-parallel size that the
dense gradients get, so the update is the one of the whole model; under ZeRO-1/2 their optimizer
state is partitioned over that group, under ZeRO-3 their weights too (the placement DeepSpeed
gives its AutoEP experts); the gradient norm counts every expert once (ZeRO-1/2/3, bf16, fp16).
Only fp32 at ZeRO stage 0 clips by DeepSpeed's mean of per-rank norms, each missing the other
ranks' experts (refused when clipping is on). DeepSpeed's pipeline engine takes the same groups:
each stage's experts are split within the stage, and a stage without MoE layers gets a plain
engine.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from llmstack.compat.deepspeed import (
    counted_as_autoep_layers,
    counted_as_moe_layers,
    moe_param_groups,
    register_expert_groups,
)
from llmstack.errors import UserError
from llmstack.models import LLMStackConfig
from llmstack.models.moe import MoEBlock
from llmstack.parallel import Topology
from llmstack.parallel.expert_parallel import expert_group_name


def check_expert_count(size: int, config: LLMStackConfig) -> None:
    """Refuse splitting the experts of `config` over `size` ranks unless they divide (the run config
    checks this before start-up unless the model comes from init_from)."""
    experts = getattr(config, "num_local_experts", 0)
    if size > 1 and (not experts or experts % size):
        raise UserError(
            f"train.expert_parallel_size {size} must divide the model's num_local_experts "
            f"({experts}): expert parallelism splits the experts of a mixture-of-experts model"
        )


def named_param_groups(param_groups: list[dict[str, Any]], topology: Topology) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, the experts in groups of their own when they are split."""
    named = [{"name": f"group{i}", **group} for i, group in enumerate(param_groups)]
    return moe_param_groups(named) if topology.expert_parallel_size > 1 else param_groups


@contextlib.contextmanager
def engine_with_experts(topology: Topology, zero_stage: int) -> Iterator[None]:
    """Build the DeepSpeed engine within this block: with experts split, DeepSpeed sees the MoE
    blocks (as its AutoEP layers at ZeRO stage 3, the only MoE layers stage 3 takes) and the
    expert groups (see llmstack.compat.deepspeed)."""
    if topology.expert_parallel_size == 1:
        yield
        return
    register_expert_groups(
        expert_group_name(topology.expert_parallel_size),
        topology.expert_parallel_group,
        topology.expert_data_parallel_group,
    )
    with (counted_as_autoep_layers if zero_stage == 3 else counted_as_moe_layers)(MoEBlock):
        yield
