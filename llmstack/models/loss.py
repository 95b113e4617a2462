"""Next-token targets and the causal LM loss, shared by the model, the parallel layers and evaluation.

Targets are aligned with the logits: targets[:, t] is the token that follows input position t,
IGNORE_INDEX where nothing is scored (a prompt, padding, the last position of a sequence).

The loss is a sum of per-token losses divided by a normalizer, `num_items_in_batch` (Hugging
Face's name for it). Without one the normalizer is the number of scored targets, so the loss is
their mean. A training loop that accumulates gradients over micro-batches and data-parallel ranks
passes the step's target count instead (scaled to what its engine divides by), so that every token
of the step weighs the same whatever batch it came in; evaluation passes 1 to get the sum.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def next_token_targets(
    labels: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The targets a forward call scores: `shift_labels` as given (already aligned with the logits),
    else Hugging Face `labels` (aligned with input_ids) shifted left by one; None when neither."""
    if shift_labels is not None or labels is None:
        return shift_labels
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def split_block(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets) of packed token blocks (..., n + 1): n inputs, each scoring the token after it."""
    return block[..., :-1], block[..., 1:]


def count_targets(targets: torch.Tensor) -> torch.Tensor:
    """Number of scored targets (not IGNORE_INDEX)."""
    return (targets != IGNORE_INDEX).sum()


def causal_lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross entropy (with label smoothing) plus PaLM's z-loss (z_loss x log(Z)^2), summed
    over targets != IGNORE_INDEX and divided by `num_items_in_batch` (default: their number, a mean).

    `targets` are already aligned with `logits` (see `next_token_targets`, `split_block`).
    """
    logits = logits.float().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    normalizer = count_targets(targets) if num_items_in_batch is None else num_items_in_batch
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing, reduction="sum")
    if z_loss:
        log_z = torch.logsumexp(logits[targets != IGNORE_INDEX], dim=-1)
        loss = loss + z_loss * log_z.pow(2).sum()
    return loss / normalizer


__all__ = ["IGNORE_INDEX", "causal_lm_loss", "count_targets", "next_token_targets", "split_block"]
