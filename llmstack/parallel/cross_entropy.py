"""Cross entropy over logits split by vocabulary across the tensor-parallel group.

Each rank holds logits (or output weights) for its own vocabulary rows; full-vocabulary logits
never exist on one rank. Per token, the ranks exchange a few numbers (the max logit, the sum of
exponentials, the target's logit; the sum of logits with label smoothing) instead of a row of the
vocabulary's size. The loss formula is llmstack.models.loss's, given a `VocabShard` that says where
this rank's columns sit and sums the per-token parts with all-reduces.
"""

import torch
import torch.distributed as dist

from llmstack.models.loss import VocabShard, causal_lm_loss, linear_cross_entropy

from .mappings import reduce_from_tensor_parallel_region, shard_sizes


def vocab_shard(local_vocab: int, group: dist.ProcessGroup | None, vocab_size: int | None = None) -> VocabShard:
    """This rank's `VocabShard` of a balanced split of `vocab_size` (as `ColumnParallelLinear` and
    `VocabParallelEmbedding` split it; default: local_vocab x group size, an even split), whose
    per-token sums and maxima are all-reduced over `group`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    vocab_size = vocab_size or local_vocab * world
    sizes = shard_sizes(vocab_size, world)
    if local_vocab != sizes[rank]:
        raise ValueError(
            f"rank {rank} holds {local_vocab} logits, but a balanced split of a {vocab_size}-token "
            f"vocabulary over {world} ranks gives it {sizes[rank]}"
        )

    def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        return x

    return VocabShard(
        start=sum(sizes[:rank]),
        vocab_size=vocab_size,
        sum=lambda x: reduce_from_tensor_parallel_region(x, group),
        max=all_reduce_max,
    )


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    z_loss: float = 0.0,
    num_items_in_batch: float | torch.Tensor | None = None,
    focal_gamma: float = 0.0,
) -> torch.Tensor:
    """`causal_lm_loss` (llmstack.models.loss) from this rank's vocabulary shard of the logits, the
    same on every rank of `group`.

    logits_shard: (..., local vocab), the columns of rank r being its slice of a balanced split of
        `vocab_size` (default: local vocab x group size).
    targets: (...) global token ids, the same on every rank of `group`.
    """
    shard = vocab_shard(logits_shard.shape[-1], group, vocab_size)
    return causal_lm_loss(logits_shard, targets, label_smoothing, z_loss, num_items_in_batch, focal_gamma, shard)


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    z_loss: float = 0.0,
    num_items_in_batch: float | torch.Tensor | None = None,
    focal_gamma: float = 0.0,
) -> torch.Tensor:
    """`vocab_parallel_cross_entropy(hidden @ weight_shard.T, ...)` without holding those logits
    (see `linear_cross_entropy`). `hidden` is the same on every rank of `group` (inside the tensor-
    parallel region: its gradient here is this rank's part, which the region's entry all-reduces)."""
    shard = vocab_shard(weight_shard.shape[0], group, vocab_size)
    return linear_cross_entropy(
        hidden, weight_shard, targets, label_smoothing, z_loss, num_items_in_batch, focal_gamma, shard
    )
