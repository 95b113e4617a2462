"""Next-token targets and the causal LM loss, shared by the model, the parallel layers and evaluation.

Targets are aligned with the logits: targets[:, t] is the token that follows input position t,
IGNORE_INDEX where nothing is scored (a prompt, padding, the last position of a sequence).

The loss is a sum of per-token losses divided by a normalizer, `num_items_in_batch` (Hugging
Face's name for it). Without one the normalizer is the number of scored targets, so the loss is
their mean. A training loop that accumulates gradients over micro-batches and data-parallel ranks
passes the step's target count instead (scaled to what its engine divides by), so that every token
of the step weighs the same whatever batch it came in; evaluation passes 1 to get the sum.

A token's loss is cross entropy with label smoothing eps, (1 - eps) (-log p_y) + eps mean_j(-log p_j),
times the focal weight (1 - p_y)^gamma (Lin et al., 2017; gamma = 0: plain cross entropy; smoothing
changes what is weighted, not the weight), plus PaLM's z-loss coefficient x log(Z)^2.

`token_losses` computes it from logits that may be one rank's slice of the vocabulary
(`VocabShard` says where it sits and how the ranks sum their parts), so the plain, the chunked and
the vocabulary-parallel losses share one formula. `linear_cross_entropy` takes the hidden states
and the output weight instead of logits and never holds (tokens x vocabulary) logits: it goes
through the tokens a chunk at a time and computes each chunk's gradients in the forward pass.

Inside `tallying_predictions()` every loss computed here also counts its scored targets that are
the most likely token (accuracy), from values it already holds: a target is predicted when its
logit equals the maximum over the whole vocabulary (a vocabulary shard's maximum is the group's).
"""

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, runtime_checkable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# Logits elements (tokens x local vocabulary) of one chunk of `linear_cross_entropy`: at most 2^25
# (128 MiB of fp32, 256 tokens of a 128k vocabulary; a few such buffers live at once), and no more
# than the loss's input (tokens x hidden) holds, down to MIN_CHUNK_TOKENS tokens: so at long
# sequence the loss's transient memory grows with the tokens a rank holds instead of being a fixed
# 128 MiB, which is what lets context parallelism halve a small model's memory.
CHUNK_LOGITS = 2**25
MIN_CHUNK_TOKENS = 256


def chunk_tokens(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk of the loss over `tokens` hidden states against a (local) vocabulary."""
    budget = min(CHUNK_LOGITS, max(tokens * hidden_size, MIN_CHUNK_TOKENS * vocab_size))
    return max(1, budget // vocab_size)


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


class LossOptions(TypedDict):
    """The model config's loss options, as the losses here take them."""

    label_smoothing: float
    z_loss: float
    focal_gamma: float


@runtime_checkable
class HeadWithLoss(Protocol):
    """An output layer that computes the token loss of its own outputs, for a head whose outputs
    are not whole logits (llmstack.parallel's VocabParallelHead holds a vocabulary slice). The
    models call it in place of their own loss; they know nothing else of it."""

    def loss_from_hidden(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        num_items_in_batch: float | torch.Tensor | None,
        options: LossOptions,
    ) -> torch.Tensor | None: ...

    def loss_from_logits(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        num_items_in_batch: float | torch.Tensor | None,
        options: LossOptions,
    ) -> torch.Tensor: ...


def loss_options(config: Any) -> LossOptions:
    """The loss options of a model config (LLMStackConfig)."""
    return {"label_smoothing": config.label_smoothing, "z_loss": config.z_loss, "focal_gamma": config.focal_gamma}


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class VocabShard:
    """Which columns of the vocabulary a logits tensor holds, and how per-token values over the
    whole vocabulary are formed from every shard's part. The default is the whole vocabulary.

    sum: (k, tokens) partial sums -> totals; its gradient passes through unchanged (every rank
        computes the same loss from the totals).
    max: (tokens,) partial maxima -> maxima (no gradient needed).
    """

    start: int = 0
    vocab_size: int | None = None
    sum: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    max: Callable[[torch.Tensor], torch.Tensor] = _unchanged


WHOLE_VOCAB = VocabShard()


class PredictionTally:
    """Scored targets, and those the logits predicted (argmax), of the losses computed while it
    is active (see `tallying_predictions`). Counts stay tensors until read: no device sync per loss."""

    def __init__(self) -> None:
        self.correct: torch.Tensor | int = 0
        self.scored: torch.Tensor | int = 0

    def add(self, predicted: torch.Tensor, scored: torch.Tensor) -> None:
        """Count one loss's targets: `predicted` and `scored` are boolean per target."""
        self.correct = self.correct + (predicted & scored).sum()
        self.scored = self.scored + scored.sum()

    def counts(self) -> tuple[int, int]:
        """(correct, scored) so far."""
        return int(self.correct), int(self.scored)


_ACTIVE_TALLY: ContextVar[PredictionTally | None] = ContextVar("prediction_tally", default=None)


@contextlib.contextmanager
def tallying_predictions(tally: PredictionTally | None = None) -> Iterator[PredictionTally]:
    """Count the targets that every loss computed inside predicts, in `tally` (default: a new one)."""
    tally = PredictionTally() if tally is None else tally
    token = _ACTIVE_TALLY.set(tally)
    try:
        yield tally
    finally:
        _ACTIVE_TALLY.reset(token)


def _tally(predicted: Callable[[], torch.Tensor], scored: torch.Tensor) -> None:
    """Add to the active tally, if any; `predicted` is only computed when one is active."""
    tally = _ACTIVE_TALLY.get()
    if tally is not None:
        with torch.no_grad():
            tally.add(predicted(), scored)


def span_predictions(
    logits: torch.Tensor, targets: torch.Tensor, span_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted, present), boolean per (sequence, span): whether every target of span k
    (`span_ids` == k; -1 marks targets of no span) is the logits' most likely token, and whether
    the sequence has span k. Exact-span accuracy of span corruption (llmstack.data.span_corruption)."""
    in_span = (span_ids >= 0) & (targets != IGNORE_INDEX)
    wrong = (logits.argmax(-1) != targets) & in_span
    index = span_ids.clamp_min(0).long()
    spans = int(index.max()) + 1 if index.numel() else 0
    zeros = torch.zeros(index.shape[0], spans, dtype=torch.long, device=index.device)
    misses = zeros.scatter_add(1, index, wrong.long())
    present = zeros.scatter_add(1, index, in_span.long()) > 0
    return misses == 0, present


def tally_spans(logits: torch.Tensor, targets: torch.Tensor, span_ids: torch.Tensor) -> None:
    """Count the spans `span_predictions` finds, and those predicted exactly, in the active tally."""
    if _ACTIVE_TALLY.get() is not None:
        with torch.no_grad():
            predicted, present = span_predictions(logits, targets, span_ids)
        _tally(lambda: predicted, present)


def token_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    focal_gamma: float = 0.0,
    shard: VocabShard = WHOLE_VOCAB,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, log Z) per token of (tokens, vocab) `logits` (see the module docstring), computed in
    fp32 and differentiable; the loss is 0 where the target is IGNORE_INDEX."""
    logits = logits.float()
    vocab_size = shard.vocab_size or logits.shape[-1]
    max_logit = shard.max(logits.detach().max(dim=-1).values)  # log Z does not depend on the shift
    shifted = logits - max_logit.unsqueeze(-1)
    local_targets = targets - shard.start
    in_shard = (local_targets >= 0) & (local_targets < logits.shape[-1])
    target_logit = shifted.gather(-1, local_targets.masked_fill(~in_shard, 0).unsqueeze(-1)).squeeze(-1)
    partial_sums = [shifted.exp().sum(dim=-1), target_logit.masked_fill(~in_shard, 0.0)]
    if label_smoothing:
        partial_sums.append(shifted.sum(dim=-1))
    sums = shard.sum(torch.stack(partial_sums))  # one reduction for every per-token sum
    log_sum_exp = sums[0].log()
    scored = targets != IGNORE_INDEX
    # The target's logit minus the maximum is exactly 0 where it is the maximum (on any shard).
    _tally(lambda: sums[1].detach() == 0, scored)
    nll = (log_sum_exp - sums[1]).masked_fill(~scored, 0.0)
    loss = nll
    if label_smoothing:
        # -mean_j log p_j = log Z - mean_j logit_j (with the same shift on both sides).
        loss = (1.0 - label_smoothing) * nll + label_smoothing * (log_sum_exp - sums[2] / vocab_size)
    if focal_gamma:
        # 1 - p_y = -expm1(-nll), exact near p_y = 1; the floor keeps d/dp finite for gamma < 1.
        loss = loss * (-torch.expm1(-nll)).clamp_min(torch.finfo(torch.float32).tiny).pow(focal_gamma)
    return loss.masked_fill(~scored, 0.0), log_sum_exp + max_logit


def _summed_loss(loss: torch.Tensor, log_z: torch.Tensor, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    """Sum over scored targets of loss + z_loss x log(Z)^2."""
    total = loss.sum()
    if z_loss:
        total = total + z_loss * log_z.masked_fill(targets == IGNORE_INDEX, 0.0).pow(2).sum()
    return total


def causal_lm_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items_in_batch: float | torch.Tensor | None = None,
    focal_gamma: float = 0.0,
    shard: VocabShard = WHOLE_VOCAB,
) -> torch.Tensor:
    """Next-token loss (see the module docstring) summed over targets != IGNORE_INDEX and divided
    by `num_items_in_batch` (default: their number, a mean).

    `targets` are already aligned with `logits` (see `next_token_targets`, `split_block`); `logits`
    hold the whole vocabulary, or the columns `shard` names.
    """
    targets = targets.reshape(-1)
    loss, log_z = token_losses(logits.reshape(-1, logits.shape[-1]), targets, label_smoothing, focal_gamma, shard)
    normalizer = count_targets(targets) if num_items_in_batch is None else num_items_in_batch
    return _summed_loss(loss, log_z, targets, z_loss) / normalizer


# (logits, targets, label_smoothing, focal_gamma, z_loss, shard, needs_grad) -> (summed loss, grad of logits)
ChunkLoss = Callable[
    [torch.Tensor, torch.Tensor, float, float, float, VocabShard, bool], tuple[torch.Tensor, torch.Tensor | None]
]


def _autograd_chunk_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float,
    focal_gamma: float,
    z_loss: float,
    shard: VocabShard,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed loss, its gradient with respect to the fp32 `logits` or None) of one chunk, by
    autograd through token_losses: every option, any vocabulary shard."""
    logits = logits.requires_grad_(needs_grad)
    with torch.enable_grad():
        total = _summed_loss(*token_losses(logits, targets, label_smoothing, focal_gamma, shard), targets, z_loss)
    grad = torch.autograd.grad(total, logits)[0] if needs_grad else None
    return total.detach(), grad


def _closed_form_chunk_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float,
    focal_gamma: float,
    z_loss: float,
    shard: VocabShard,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_autograd_chunk_loss for the whole vocabulary without focal weighting, from one fused
    log_softmax and the closed-form gradient, overwriting `logits`: a few passes over the chunk's
    logits where autograd's graph takes about ten (the loss was ~10% of a CPU training step).

    A token's loss (1 - eps)(log Z - x_y) + eps (log Z - mean_j x_j) + z log(Z)^2 has the gradient
    p_j (1 + 2 z log Z) - (1 - eps) [j = y] - eps / V, zero for unscored tokens.
    """
    del focal_gamma, shard  # only called without them (see _LinearCrossEntropy)
    vocab_size = logits.shape[-1]
    scored = targets != IGNORE_INDEX
    safe_targets = targets.masked_fill(~scored, 0).unsqueeze(-1)
    target_logit = logits.gather(-1, safe_targets).squeeze(-1) if z_loss else None
    log_probs = torch.log_softmax(logits, dim=-1, out=logits)
    target_log_prob = log_probs.gather(-1, safe_targets).squeeze(-1)
    _tally(lambda: target_log_prob == log_probs.max(dim=-1).values, scored)
    loss = -target_log_prob
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * log_probs.mean(dim=-1)
    total = loss.masked_fill(~scored, 0.0).sum()
    weight = scored.to(logits.dtype)
    if z_loss:
        assert target_logit is not None
        log_z = target_logit - target_log_prob
        total = total + z_loss * log_z.masked_fill(~scored, 0.0).pow(2).sum()
        weight = weight * (1.0 + 2.0 * z_loss * log_z)
    if not needs_grad:
        return total, None
    grad = log_probs.exp_().mul_(weight.unsqueeze(-1))
    if label_smoothing:
        grad.sub_((label_smoothing / vocab_size) * scored.to(grad.dtype).unsqueeze(-1))
    grad.scatter_add_(-1, safe_targets, -(1.0 - label_smoothing) * scored.to(grad.dtype).unsqueeze(-1))
    return total, grad


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed loss of (tokens, hidden) x (local vocab, hidden)^T logits, a chunk of tokens at a time.

    The loss is a scalar, so each chunk's gradients are computed in the forward pass (from the chunk's
    logits, then dropped) and the backward pass only scales them: no logits outlive their chunk.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        label_smoothing: float,
        focal_gamma: float,
        z_loss: float,
        shard: VocabShard,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # needs_input_grad is set under torch.no_grad() too: the caller's grad mode decides.
        needs_hidden_grad, needs_weight_grad = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        grad_hidden = torch.empty_like(hidden) if needs_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight_grad else None
        ctx.weight_dtype = weight.dtype
        total = hidden.new_zeros((), dtype=torch.float32)
        chunk = chunk_tokens(hidden.shape[0], hidden.shape[1], weight.shape[0])
        closed_form = shard is WHOLE_VOCAB and not focal_gamma
        chunk_loss: ChunkLoss = _closed_form_chunk_loss if closed_form else _autograd_chunk_loss
        for start in range(0, hidden.shape[0], chunk):
            chunk_hidden, chunk_targets = hidden[start : start + chunk], targets[start : start + chunk]
            logits = (chunk_hidden @ weight.t()).float()
            needs_grad = needs_hidden_grad or needs_weight_grad
            chunk_total, grad_logits = chunk_loss(
                logits, chunk_targets, label_smoothing, focal_gamma, z_loss, shard, needs_grad
            )
            total += chunk_total
            if grad_logits is not None:
                grad_logits = grad_logits.to(weight.dtype)  # as autograd casts it back through .float()
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk] = grad_logits @ weight
                if grad_weight is not None:  # accumulated over chunks in fp32
                    grad_weight += grad_logits.t() @ chunk_hidden
            del logits, grad_logits  # or they would live on while the next chunk's logits are computed
        # Kept as attributes, not saved tensors, so that backward hands over the only reference
        # (autograd then adopts them as .grad instead of copying).
        ctx.grads = [grad_hidden, grad_weight]
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.grads
        del ctx.grads
        if grad_hidden is not None:
            grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items_in_batch: float | torch.Tensor | None = None,
    focal_gamma: float = 0.0,
    shard: VocabShard = WHOLE_VOCAB,
) -> torch.Tensor:
    """`causal_lm_loss(hidden @ weight.T, targets, ...)` (same value and gradients for hidden and
    weight) without ever holding the (tokens x vocabulary) logits: a chunk of `chunk_tokens` at a time.

    hidden: (..., hidden) final hidden states; weight: (vocab, hidden) output weights, or this rank's
    rows of them as `shard` names (then hidden must be the same on every rank of the shard's group).
    """
    targets = targets.reshape(-1)
    total = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets,
        label_smoothing,
        focal_gamma,
        z_loss,
        shard,
        torch.is_grad_enabled(),
    )
    normalizer = count_targets(targets) if num_items_in_batch is None else num_items_in_batch
    return total / normalizer


__all__ = [
    "IGNORE_INDEX",
    "LossOptions",
    "PredictionTally",
    "loss_options",
    "VocabShard",
    "causal_lm_loss",
    "count_targets",
    "linear_cross_entropy",
    "next_token_targets",
    "split_block",
    "tally_spans",
    "tallying_predictions",
    "token_losses",
]
