"""Autograd functions that move activations into and out of the tensor-parallel region.

As in Megatron-LM, each is a pair of collectives, one in the forward pass and its adjoint in the
backward pass:

    copy_to       forward: identity                   backward: all-reduce
    reduce_from   forward: all-reduce                 backward: identity
    scatter_to    forward: keep this rank's slice     backward: all-gather      (last dimension)
    gather_from   forward: all-gather                 backward: keep the slice  (last dimension)

Splits along the last dimension may be uneven (`sizes`: every rank's width, in rank order), which
is how a vocabulary that does not divide by the tensor-parallel size is split.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def shard_sizes(total, world_size):
    """Balanced split of `total` rows over `world_size` ranks; the first `total % world_size` get one extra."""
    base, extra = divmod(total, world_size)
    return [base + (r < extra) for r in range(world_size)]


def _rank_and_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def _split_last_dim(x, group, sizes):
    rank, world = _rank_and_size(group)
    if world == 1:
        return x
    sizes = sizes or [x.shape[-1] // world] * world
    return x.split(sizes, dim=-1)[rank].contiguous()


def _gather_last_dim(x, group, sizes):
    world = dist.get_world_size(group)
    if world == 1:
        return x
    sizes = sizes or [x.shape[-1]] * world
    width = max(sizes)
    padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)


def _all_reduce(x, group):
    if dist.get_world_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _split_last_dim(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group, ctx.sizes), None, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_last_dim(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group, ctx.sizes), None, None


def copy_to_tensor_parallel_region(x, group):
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group, sizes=None):
    return _ScatterToTensorParallelRegion.apply(x, group, sizes)


def gather_from_tensor_parallel_region(x, group, sizes=None):
    return _GatherFromTensorParallelRegion.apply(x, group, sizes)
