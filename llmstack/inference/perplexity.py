"""Token-weighted perplexity over held-out token blocks.

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


@torch.no_grad()
def evaluate_perplexity(model, batches, *, max_batches=None, dp_group=None):
    """{"loss", "perplexity", "tokens"} of `model` on `batches` of token blocks.

    batches: token tensors of shape (batch, n + 1) or (n + 1,), e.g. `PackedBlocks.eval_batches`
        or a list of documents; lengths may differ between batches.
    model: a causal LM returning `.logits`, or a DeepSpeed engine wrapping one.
    dp_group: a process group whose ranks each evaluated their own share of the data; the sums
        are added over it, so every rank returns the result for all the data.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.long, device=device)
    try:
        for block in itertools.islice(batches, max_batches):
            block = torch.as_tensor(block, device=device).long()
            block = block.unsqueeze(0) if block.dim() == 1 else block
            logits = model(input_ids=block[:, :-1]).logits
            targets = block[:, 1:]
            nll += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").double()
            tokens += targets.numel()
    finally:
        model.train(was_training)
    if dp_group is not None:
        dist.all_reduce(nll, group=dp_group)
        dist.all_reduce(tokens, group=dp_group)
    if tokens.item() == 0:
        raise UserError("no tokens to evaluate: give held-out data with at least one block of seq_len + 1 tokens")
    loss = nll.item() / tokens.item()
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(tokens.item())}
