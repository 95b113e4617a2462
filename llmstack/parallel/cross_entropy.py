"""Cross entropy over logits split by vocabulary across the tensor-parallel group.

Each rank holds logits for its own vocabulary rows; full-vocabulary logits never exist on one
rank. Per token, the ranks exchange three numbers (the max logit, the sum of exponentials, the
target's logit; a fourth, the sum of logits, with label smoothing) instead of a row of the
vocabulary's size. The backward pass is written out, as in Megatron-LM, so that only the local
softmax is kept for it.
"""

from typing import Any

import torch
import torch.distributed as dist

from llmstack.models.loss import IGNORE_INDEX

from .mappings import shard_sizes


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token (loss, log Z) from a (tokens, local vocab) logits shard."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        label_smoothing: float,
        group: dist.ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.dtype = logits.dtype
        logits = logits.float()
        max_logit = logits.max(dim=-1).values
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logit.unsqueeze(-1)

        local_targets = targets - vocab_start
        in_shard = (local_targets >= 0) & (local_targets < logits.shape[-1])
        local_targets = local_targets.masked_fill(~in_shard, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        exp = shifted.exp()
        # One all-reduce for every per-token sum.
        per_token = [exp.sum(dim=-1), target_logit]
        if label_smoothing:
            per_token.append(shifted.sum(dim=-1))
        sums = torch.stack(per_token)
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing:
            # -mean_j log p_j = log Z - mean_j logit_j (with the same shift on both sides).
            smooth = log_sum_exp - sums[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_targets, in_shard)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss, log_sum_exp + max_logit

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor, grad_log_z: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        softmax, local_targets, in_shard = ctx.saved_tensors
        eps = ctx.label_smoothing
        # d loss / d logit_j = p_j - (1 - eps) [j = target] - eps / V;   d log Z / d logit_j = p_j
        grad = softmax.mul_((grad_loss + grad_log_z).unsqueeze(-1))
        target_grad = (1.0 - eps) * grad_loss * in_shard
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), -target_grad.unsqueeze(-1))
        if eps:
            grad.sub_((eps / ctx.vocab_size) * grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    *,
    group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    z_loss: float = 0.0,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_lm_loss` (llmstack.models.loss) from this rank's vocabulary shard of the logits: cross
    entropy with label smoothing plus z_loss x log(Z)^2, summed over targets != ignore_index and
    divided by `num_items_in_batch` (default: their number, a mean).

    Equals `F.cross_entropy(full_logits, targets, ignore_index=..., label_smoothing=...)` on the
    gathered logits when there is no z-loss and no `num_items_in_batch`.

    logits_shard: (..., local vocab), the columns of rank r being its slice of a balanced split of
        `vocab_size` (as `ColumnParallelLinear` and `VocabParallelEmbedding` split it).
    targets: (...) global token ids, the same on every rank of `group`.
    vocab_size: the full vocabulary; defaults to local vocab x group size (an even split).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    vocab_size = vocab_size or logits_shard.shape[-1] * world
    sizes = shard_sizes(vocab_size, world)
    if logits_shard.shape[-1] != sizes[rank]:
        raise ValueError(
            f"rank {rank} holds {logits_shard.shape[-1]} logits, but a balanced split of a {vocab_size}-token "
            f"vocabulary over {world} ranks gives it {sizes[rank]}"
        )
    logits_shard = logits_shard.reshape(-1, logits_shard.shape[-1])
    targets = targets.reshape(-1)
    loss, log_z = _VocabParallelCrossEntropy.apply(
        logits_shard, targets, sum(sizes[:rank]), vocab_size, label_smoothing, group
    )
    valid = targets != ignore_index
    loss = loss.masked_fill(~valid, 0.0).sum()
    if z_loss:
        loss = loss + z_loss * log_z.masked_fill(~valid, 0.0).pow(2).sum()
    return loss / (valid.sum() if num_items_in_batch is None else num_items_in_batch)
