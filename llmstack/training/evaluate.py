"""Token-weighted perplexity over held-out data: the one evaluation of `llmstack eval` and the trainer.

Every block of n + 1 tokens scores its last n tokens, each predicted from the tokens before it
in the block. The loss is the mean negative log-likelihood over all scored tokens of all blocks
(not a mean of per-batch means), and the count of scored tokens is reported exactly. It is the
plain NLL: label smoothing and z-loss shape training only, so runs with and without them compare.

A masked LM (llmstack.data.mlm's batches, `masked_lm_nll`) is scored on its masked tokens
instead, each predicted from the whole corrupted block. Every evaluation also reports the
fraction of scored targets whose most likely token is the target (`accuracy`: next-token
accuracy, masked-token accuracy for a masked LM). An encoder-decoder trained on span corruption
(llmstack.data.span_corruption's batches, `span_corruption_nll`) is scored on its targets, each
predicted from the corrupted inputs and the targets before it, and reports exact-span accuracy
instead (`span_accuracy`: the fraction of masked spans whose sentinel and tokens are all the
most likely tokens).

A perplexity too large for a float (mean NLL above ~709.78) is reported as infinity, never as a
clamped number that would look like a measurement.
"""

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from llmstack.errors import UserError
from llmstack.models.loss import (
    causal_lm_loss,
    count_targets,
    next_token_targets,
    span_predictions,
    split_block,
    tallying_predictions,
)

# (model, batch) -> (summed negative log-likelihood, number of scored targets, *further counts) of one batch
BatchNLL = Callable[..., tuple[torch.Tensor, ...]]


def inputs_and_targets(batch: torch.Tensor | dict | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets) of a token block (batch, n + 1) / (n + 1,), or of a fine-tuning batch
    {"input_ids", "labels"} whose labels follow Hugging Face (aligned with the inputs, -100 not
    scored). targets[:, t] is the token that follows input position t."""
    if isinstance(batch, dict) and "shift_labels" in batch:  # a document-masked packed batch
        return batch["input_ids"], batch["shift_labels"]
    if isinstance(batch, dict):
        targets = next_token_targets(labels=batch["labels"])
        assert targets is not None  # labels were given
        return batch["input_ids"], targets
    block = torch.as_tensor(batch).long()
    return split_block(block.unsqueeze(0) if block.dim() == 1 else block)


def model_nll(
    model: torch.nn.Module, batch: torch.Tensor | dict, token_loss: Callable = causal_lm_loss
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed NLL, scored targets and correctly predicted targets (the most likely token) of one
    batch (see `inputs_and_targets`) under `model`'s logits.

    token_loss: `causal_lm_loss`, or a function of the same signature for logits that are not whole
        (vocab_parallel_cross_entropy bound to its group for a tensor-parallel model).
    """
    input_ids, targets = inputs_and_targets(batch)
    return _scored_nll(model, batch, input_ids, targets, token_loss)


def masked_lm_nll(
    model: torch.nn.Module, batch: dict, token_loss: Callable = causal_lm_loss
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`model_nll` of a masked-LM batch {"input_ids", "labels"} whose labels are aligned with the
    inputs (llmstack.data.mlm): each masked token predicted from the whole corrupted block."""
    return _scored_nll(model, batch, batch["input_ids"], batch["labels"], token_loss)


def span_corruption_nll(
    model: torch.nn.Module, batch: dict, token_loss: Callable = causal_lm_loss
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed NLL and scored targets of a span-corruption batch {"input_ids", "labels",
    "span_ids"} under an encoder-decoder (llmstack's or stock T5), its spans predicted exactly and
    its spans."""
    device = next(model.parameters()).device
    labels = batch["labels"].to(device)
    logits = model(input_ids=batch["input_ids"].to(device), labels=labels).logits
    with tallying_predictions():  # token accuracy is not reported (spans are)
        nll = token_loss(logits, labels, num_items_in_batch=1)
    predicted, present = span_predictions(logits, labels, batch["span_ids"].to(device))
    return nll, count_targets(labels), (predicted & present).sum(), present.sum()


def _scored_nll(
    model: torch.nn.Module,
    batch: torch.Tensor | dict,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    token_loss: Callable,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    input_ids, targets = input_ids.to(device), targets.to(device)
    # Prompt tuning prepends virtual tokens; the last positions are the inputs'.
    logits = model(input_ids=input_ids, **document_inputs(batch, device)).logits[:, -input_ids.shape[1] :]
    with tallying_predictions() as tally:
        nll = token_loss(logits, targets, num_items_in_batch=1)
    return nll, count_targets(targets), torch.as_tensor(tally.correct)


def document_inputs(batch: torch.Tensor | dict | Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
    """A document-masked batch's "position_ids" and "document_ids" on `device` (none for others)."""
    if not isinstance(batch, dict):
        return {}
    return {k: batch[k].to(device) for k in ("position_ids", "document_ids") if k in batch}


def perplexity(loss: float) -> float:
    """exp(loss), or infinity where that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module,
    batches: Iterable,
    *,
    max_batches: int | None = None,
    dp_group: dist.ProcessGroup | None = None,
    batch_nll: BatchNLL = model_nll,
) -> dict:
    """{"loss", "perplexity", "tokens", "accuracy"} of `model` on `batches` (see `inputs_and_targets`), e.g.
    `PackedBlocks.eval_batches(...)`, a list of documents, or fine-tuning batches.

    model: a causal LM returning `.logits` (a peft model too), or a DeepSpeed engine wrapping one.
    dp_group: a process group whose ranks each evaluated their own share of the data; the sums
        are added over it, so every rank returns the result for all the data.
    batch_nll: how one batch is scored (`model_nll`, bound to another token loss, `masked_lm_nll`,
        or a pipeline's scoring of a group of micro-batches): (summed NLL, scored, correct); or
        `span_corruption_nll`'s (summed NLL, scored, correct spans, spans), reported as
        "span_accuracy" in place of "accuracy".
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # NLL, scored targets, correct predictions (targets or spans), spans
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    try:
        for batch in itertools.islice(batches, max_batches):
            counts = [count.to(device, torch.float64) for count in batch_nll(model, batch)]
            sums[: len(counts)] += torch.stack(counts)
    finally:
        model.train(was_training)
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    nll, tokens, correct, spans = sums.tolist()
    if tokens == 0:
        raise UserError("no tokens to evaluate: give held-out data with at least one block of seq_len + 1 tokens")
    return {
        "loss": nll / tokens,
        "perplexity": perplexity(nll / tokens),
        "tokens": int(tokens),
        **({"span_accuracy": correct / spans} if spans else {"accuracy": correct / tokens}),
    }
