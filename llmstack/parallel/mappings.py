"""Autograd functions that move activations into and out of the tensor-parallel region.

As in Megatron-LM, each is a pair of collectives, one in the forward pass and its adjoint in the
backward pass:

    copy_to       forward: identity                   backward: all-reduce
    reduce_from   forward: all-reduce                 backward: identity
    scatter_to    forward: keep this rank's slice     backward: all-gather      (last dimension)
    gather_from   forward: all-gather                 backward: keep the slice  (last dimension)

and, for sequence parallelism, along the sequence (dim 1 of batch x seq x hidden):

    gather_from_sequence          forward: all-gather        backward: reduce-scatter
    reduce_scatter_to_sequence    forward: reduce-scatter    backward: all-gather

Splits along the last dimension may be uneven (`sizes`: every rank's width, in rank order), which
is how a vocabulary that does not divide by the tensor-parallel size is split.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQUENCE_DIM = 1


def shard_sizes(total: int, world_size: int) -> list[int]:
    """Balanced split of `total` rows over `world_size` ranks; the first `total % world_size` get one extra."""
    base, extra = divmod(total, world_size)
    return [base + (r < extra) for r in range(world_size)]


def _split_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int] | None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    sizes = sizes or [x.shape[-1] // world] * world
    return x.split(sizes, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int] | None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    sizes = sizes or [x.shape[-1]] * world
    width = max(sizes)
    padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    local = x.transpose(0, SEQUENCE_DIM).contiguous()
    out = local.new_empty((world * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    return out.transpose(0, SEQUENCE_DIM)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[SEQUENCE_DIM] % world:
        raise ValueError(
            f"sequence parallelism needs the sequence length ({x.shape[SEQUENCE_DIM]}) to be a multiple of the "
            f"tensor-parallel size ({world})"
        )
    full = x.transpose(0, SEQUENCE_DIM).contiguous()
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full, group=group)
    return out.transpose(0, SEQUENCE_DIM)


def _split_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=SEQUENCE_DIM)[dist.get_rank(group)].contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int] | None
    ) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        return _split_last_dim(x, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last_dim(grad, ctx.group, ctx.sizes), None, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int] | None
    ) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        return _gather_last_dim(x, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split_last_dim(grad, ctx.group, ctx.sizes), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group), None


class _GatherWholeSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_sequence(grad, ctx.group), None


class _SplitToSequenceShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    return _ScatterToTensorParallelRegion.apply(x, group, sizes)


def gather_from_tensor_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    return _GatherFromTensorParallelRegion.apply(x, group, sizes)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def gather_whole_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence from its shards, for a computation every rank then runs alike on it
    (its gradient arrives whole on every rank, so each keeps its shard's: Megatron's gather with
    tensor_parallel_output_grad=False)."""
    return _GatherWholeSequence.apply(x, group)


def split_to_sequence_shard(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's sequence shard of a tensor every rank holds whole (the gradient is gathered back)."""
    return _SplitToSequenceShard.apply(x, group)


def enter_tensor_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool = False
) -> torch.Tensor:
    """x as the column-parallel layers of a sub-layer read it: replicated (`copy_to`), or gathered
    from its sequence shards."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def leave_tensor_parallel_region(
    partial_sums: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool = False
) -> torch.Tensor:
    """Sum of the ranks' partial results: replicated (`reduce_from`), or scattered into sequence shards."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(partial_sums, group)
    return reduce_from_tensor_parallel_region(partial_sums, group)
