"""Expert parallelism: each rank of an expert-parallel group holds experts/size of every MoE block's
experts, and tokens travel to their experts and back by all-to-all.

    expert_parallelize(model, topology.expert_parallel_group)   # after building the full model
                                                                # (and after `parallelize`, if any)

With tensor parallelism, the experts split here are a tensor-parallel rank's (whole experts, see
tensor_parallel.TensorParallelExperts), and the group joins the ranks of one tensor-parallel rank.

The group divides the data-parallel group (`Topology(expert_parallel_size=...)`): its ranks see
different tokens, so every MoE block exchanges, per forward pass,

    counts    all-to-all of the rows each rank sends to each of the receiver's experts (int64)
    dispatch  all-to-all of the kept (token, expert) rows to the ranks holding their experts
    combine   all-to-all of the expert outputs back to the tokens' ranks

and the backward pass runs dispatch and combine in reverse. The router, the loss and the routing
statistics stay per rank, exactly as without expert parallelism, so a model computes the same
on any expert-parallel size.

Gradients: each rank's expert gradients already sum every data-parallel rank's loss over the
tokens it routed there, so, with the data-parallel mean that the dense parameters get, they are
divided by the data-parallel size and all-reduced only over the ranks holding the same experts
(the expert-data-parallel group). Expert parameters carry DeepSpeed's markers for that
(llmstack.compat.deepspeed.mark_expert_parameter: `allreduce = False`, `group_name = "ep_size_N"`,
and ZeRO-3's placement over that group).
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmstack.compat.deepspeed import is_tensor_parallel, mark_expert_parameter, mark_tensor_parallel
from llmstack.errors import UserError
from llmstack.models.moe import Experts, MoEBlock


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `input_splits` to the ranks of `group`; `output_splits` from each.
    Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, output_splits, input_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class ExpertParallelDispatch:
    """An `MoEBlock.dispatch` that sends rows grouped by global expert to the ranks holding those
    experts (rank r holds experts r x local ... (r + 1) x local - 1) and brings the outputs back."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        # One count per global expert (ZeRO-3 leaves the experts' own shapes empty between passes).
        world = dist.get_world_size(self.group)
        local = counts.numel() // world
        received = torch.empty_like(counts)  # [source rank, local expert]: rows each source sends
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(world, local)
        input_splits = counts.view(world, local).sum(1).tolist()
        output_splits = received.sum(1).tolist()
        rows = all_to_all(x, output_splits, input_splits, self.group)
        # Received rows come by source, then expert; the experts want them by expert.
        expert_of_row = torch.arange(local, device=x.device).repeat(world).repeat_interleave(received.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        y = experts(rows[order], received.sum(0).tolist())[torch.argsort(order)]
        return all_to_all(y, input_splits, output_splits, self.group)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def expert_group_name(expert_parallel_size: int) -> str:
    """DeepSpeed's name for the expert-parallel group of this size."""
    return f"ep_size_{expert_parallel_size}"


def expert_parallelize(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Keep this rank's share of every MoE block's experts (in place) and route through `group`.
    UserError if the expert count does not divide by the group's size."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for block in moe_blocks(model):
        held = block.experts.num_experts  # all of them, or a tensor-parallel rank's share of each rank's
        if held % world:
            raise UserError(
                f"num_local_experts ({block.num_experts}) must be a multiple of the expert-parallel size ({world})"
            )
        local = held // world
        mine = slice(rank * local, (rank + 1) * local)
        for name in ("gate_up_proj", "down_proj"):
            held_param = getattr(block.experts, name)
            param = nn.Parameter(held_param.detach()[mine].clone())
            if is_tensor_parallel(held_param):  # a tensor-parallel rank's own experts: its norm counts them
                mark_tensor_parallel(param)
            mark_expert_parameter(param, expert_group_name(world))
            setattr(block.experts, name, param)
        block.dispatch = ExpertParallelDispatch(group)


def is_expert_parameter(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def gather_expert_state_dict(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """`model`'s state dict with every MoE block's experts gathered from the expert-parallel group
    (all ranks call it; each gets the whole model's), as one model without expert parallelism."""
    state = model.state_dict()
    world = dist.get_world_size(group)
    for name, param in model.named_parameters():
        if is_expert_parameter(param):
            parts = [torch.empty_like(param) for _ in range(world)]
            dist.all_gather(parts, param.detach().contiguous(), group=group)
            state[name] = torch.cat(parts)
    return state


def all_to_all_bytes(
    num_experts: int, sent_rows: int, received_rows: int, hidden: int, itemsize: int, backward: bool = True
) -> int:
    """Bytes one MoE block's all-to-alls move from one rank by CommStats' convention (each call's
    input buffer): the counts (int64 per global expert), the rows this rank dispatches and the
    rows its experts return; the backward pass sends the same rows the other way."""
    rows = (sent_rows + received_rows) * hidden * itemsize
    return num_experts * 8 + rows * (2 if backward else 1)


__all__ = [
    "ExpertParallelDispatch",
    "all_to_all",
    "all_to_all_bytes",
    "expert_group_name",
    "expert_parallelize",
    "gather_expert_state_dict",
    "is_expert_parameter",
    "moe_blocks",
]
