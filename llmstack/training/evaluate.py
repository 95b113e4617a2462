"""Token-weighted perplexity over held-out data.

Every block of n + 1 tokens scores its last n tokens, each predicted from the tokens before it
in the block. The loss is the mean negative log-likelihood over all scored tokens of all blocks
(not a mean of per-batch means), and the count of scored tokens is reported exactly.
"""

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmstack.errors import UserError
from llmstack.models.modeling_llmstack import IGNORE_INDEX


def inputs_and_targets(batch):
    """(input_ids, targets) of a token block (batch, n + 1) / (n + 1,), or of a fine-tuning batch
    {"input_ids", "labels"} whose labels follow Hugging Face (aligned with the inputs, -100 not
    scored). targets[:, t] is the token that follows input position t."""
    if isinstance(batch, dict):
        labels = batch["labels"]
        return batch["input_ids"], F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    block = torch.as_tensor(batch).long()
    block = block.unsqueeze(0) if block.dim() == 1 else block
    return block[:, :-1], block[:, 1:]


@torch.no_grad()
def evaluate_perplexity(model, batches, *, max_batches=None, dp_group=None):
    """{"loss", "perplexity", "tokens"} of `model` on `batches` (see `inputs_and_targets`), e.g.
    `PackedBlocks.eval_batches(...)`, a list of documents, or fine-tuning batches.

    model: a causal LM returning `.logits` (a peft model too), or a DeepSpeed engine wrapping one.
    dp_group: a process group whose ranks each evaluated their own share of the data; the sums
        are added over it, so every rank returns the result for all the data.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.long, device=device)
    try:
        for batch in itertools.islice(batches, max_batches):
            input_ids, targets = (t.to(device) for t in inputs_and_targets(batch))
            # Prompt tuning prepends virtual tokens; the last positions are the inputs'.
            logits = model(input_ids=input_ids).logits[:, -input_ids.shape[1] :]
            nll += F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).double()
            tokens += (targets != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if dp_group is not None:
        dist.all_reduce(nll, group=dp_group)
        dist.all_reduce(tokens, group=dp_group)
    if tokens.item() == 0:
        raise UserError("no tokens to evaluate: give held-out data with at least one block of seq_len + 1 tokens")
    loss = nll.item() / tokens.item()
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": int(tokens.item())}
