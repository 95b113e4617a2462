"""Token-weighted perplexity over held-out data: the one evaluation of `llmstack eval` and the trainer.

Every block of n + 1 tokens scores its last n tokens, each predicted from the tokens before it
in the block. The loss is the mean negative log-likelihood over all scored tokens of all blocks
(not a mean of per-batch means), and the count of scored tokens is reported exactly. It is the
plain NLL: label smoothing and z-loss shape training only, so runs with and without them compare.

A masked LM (llmstack.data.mlm's batches, `masked_lm_nll`) is scored on its masked tokens
instead, each predicted from the whole corrupted block, and also reports the fraction of them
whose most likely token is the original (`accuracy`).

A perplexity too large for a float (mean NLL above ~709.78) is reported as infinity, never as a
clamped number that would look like a measurement.
"""

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from llmstack.errors import UserError
from llmstack.models.loss import IGNORE_INDEX, causal_lm_loss, count_targets, next_token_targets, split_block

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL and scored targets of one batch (see `inputs_and_targets`) under `model`'s logits.

    token_loss: `causal_lm_loss`, or a function of the same signature for logits that are not whole
        (vocab_parallel_cross_entropy bound to its group for a tensor-parallel model).
    """
    device = next(model.parameters()).device
    input_ids, targets = (t.to(device) for t in inputs_and_targets(batch))
    # Prompt tuning prepends virtual tokens; the last positions are the inputs'.
    logits = model(input_ids=input_ids, **document_inputs(batch, device)).logits[:, -input_ids.shape[1] :]
    return token_loss(logits, targets, num_items_in_batch=1), count_targets(targets)


def masked_lm_nll(
    model: torch.nn.Module, batch: dict, whole_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed NLL, scored targets and correctly predicted targets (argmax) of a masked-LM batch
    {"input_ids", "labels"} whose labels are aligned with the inputs (llmstack.data.mlm).
    `whole_logits`: the whole vocabulary's logits from the model's (a tensor-parallel model's are
    its rank's slice)."""
    device = next(model.parameters()).device
    input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    logits = model(input_ids=input_ids, **document_inputs(batch, device)).logits
    if whole_logits is not None:
        logits = whole_logits(logits)
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
    return causal_lm_loss(logits, labels, num_items_in_batch=1), count_targets(labels), correct


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
    rates: Sequence[str] = (),
) -> dict:
    """{"loss", "perplexity", "tokens"} of `model` on `batches` (see `inputs_and_targets`), e.g.
    `PackedBlocks.eval_batches(...)`, a list of documents, or fine-tuning batches.

    model: a causal LM returning `.logits` (a peft model too), or a DeepSpeed engine wrapping one.
    dp_group: a process group whose ranks each evaluated their own share of the data; the sums
        are added over it, so every rank returns the result for all the data.
    batch_nll: how one batch is scored (`model_nll`, bound to another token loss, or a pipeline's
        scoring of a group of micro-batches).
    rates: names of the further counts `batch_nll` returns, each reported as a fraction of the
        scored targets (("accuracy",) with `masked_lm_nll`).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(2 + len(rates), dtype=torch.float64, device=device)  # NLL, scored targets, rates
    try:
        for batch in itertools.islice(batches, max_batches):
            sums += torch.stack([count.to(device, torch.float64) for count in batch_nll(model, batch)])
    finally:
        model.train(was_training)
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    nll, tokens, *counts = sums.tolist()
    if tokens == 0:
        raise UserError("no tokens to evaluate: give held-out data with at least one block of seq_len + 1 tokens")
    result = {"loss": nll / tokens, "perplexity": perplexity(nll / tokens), "tokens": int(tokens)}
    return {**result, **{name: count / tokens for name, count in zip(rates, counts, strict=True)}}
