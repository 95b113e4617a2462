"""All-gather of a batch dimension over data-parallel ranks, with the gradient through the gather.

Contrastive training scores each rank's queries against every rank's keys (in-batch negatives
of the global batch). Each rank's loss L_r depends on every rank's embeddings, so the gradient
of the global loss sum_r L_r with respect to this rank's slice is the sum over ranks of
dL_r/d(slice): the backward all-reduces the gathered gradient and keeps this rank's rows. With
DeepSpeed averaging the parameter gradients over the ranks, the update follows the gradient of
mean_r L_r, the loss one process computes on the whole global batch.
"""

from typing import Any

import torch
import torch.distributed as dist


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        ctx.rank, ctx.rows = dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def gather_batch(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `x` (the same shape on every rank) concatenated along dim 0 in group-rank
    order; the gradient of this rank's rows is the sum over ranks of the gathered gradient's rows.
    `x` itself without a process group or with one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    return _GatherBatch.apply(x, group)
