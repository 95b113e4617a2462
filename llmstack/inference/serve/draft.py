"""A draft model for the engine's speculative decoding: a smaller model with the same tokenizer
that guesses the next tokens of every running sequence, batched, over a slotted KV cache of its
own whose slots mirror the engine's (same slot per sequence, same moves)."""

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..sampling import SamplingParams, probabilities
from .kv_cache import CacheShape, CacheView, SlotKVCache


@dataclass
class DraftInput:
    """What the draft needs of one running sequence."""

    tokens: list[int]  # prompt and outputs so far
    sampling: SamplingParams
    seen: torch.Tensor  # (1, vocab), for the repetition penalty
    generator: torch.Generator | None


class DraftModel:
    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.cache = SlotKVCache(CacheShape.of(model), num_slots, max_len, self.device)

    def prefill(self, slot: int, token_ids: list[int], start: int = 0) -> None:
        """Prefill prompt tokens `token_ids` at positions start.. of `slot` (a chunk of a prompt
        whose earlier tokens are there already, or a whole prompt from 0)."""
        prompt = torch.tensor([token_ids], device=self.device)
        self.model(
            prompt,
            attention_mask=torch.ones_like(prompt),
            position_ids=torch.arange(start, start + prompt.shape[1], device=self.device)[None],
            cache=CacheView(self.cache, slot=slot, start=start),
            use_cache=True,
            logits_to_keep=1,
        )

    def move(self, source: int, target: int, length: int) -> None:
        self.cache.move(source, target, length)

    def propose(self, batch: Seq[DraftInput], k: int) -> tuple[list[list[int]], torch.Tensor | None]:
        """k guesses for each sequence (in slots 0..n-1), each drawn from the draft's distribution
        under the sequence's sampling parameters, and those distributions (n, k, vocab) (None
        when greedy: the guesses are then the draft's argmax).

        The draft's cache holds every token but the last two for sure (the previous step's guesses
        up to the first rejected one, and not the last accepted one when all were), so the first
        forward feeds the last two tokens again; each later one feeds the previous guess."""
        lengths = torch.tensor([len(b.tokens) - 2 for b in batch], device=self.device)
        step = torch.tensor([b.tokens[-2:] for b in batch], device=self.device)
        seen = [b.seen.clone() for b in batch]
        guesses: list[list[int]] = [[] for _ in batch]
        dists: list[torch.Tensor] = []
        for _ in range(k):
            view = CacheView(self.cache, lengths=lengths, new_tokens=step.shape[1])
            logits = self.model(
                step,
                attention_mask=view.attention_mask(),
                position_ids=lengths[:, None] + torch.arange(step.shape[1], device=self.device),
                cache=view,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            view.commit()
            rows = []
            for row, b in enumerate(batch):
                probs = probabilities(logits[row : row + 1], b.sampling, seen[row])
                if b.sampling.greedy:
                    token = int(probs.argmax())
                else:
                    token = int(torch.multinomial(probs[0], 1, generator=b.generator))
                guesses[row].append(token)
                seen[row][0, token] = True
                rows.append(probs)
            dists.append(torch.cat(rows))
            lengths = lengths + step.shape[1]
            step = torch.tensor([[g[-1]] for g in guesses], device=self.device)
        greedy = all(b.sampling.greedy for b in batch)
        return guesses, None if greedy else torch.stack(dists, dim=1)
