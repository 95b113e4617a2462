"""Speculative decoding: cheap guesses of the next tokens, checked by one forward of the model.

A proposer guesses up to k tokens: prompt lookup (an n-gram of the sequence's tail found earlier
in the sequence proposes what followed it there; Saxena 2023, vLLM's `ngram`) or a smaller draft
model sharing the tokenizer. The model then scores all of them at once, and the acceptance rule
of Leviathan et al. 2023 / Chen et al. 2023 keeps a prefix: draft token d, drawn from the
proposal distribution q, is kept with probability min(1, p(d) / q(d)) under the model's
distribution p; at the first rejection a token is drawn from norm(max(0, p - q)) instead, and
when every draft token is kept one more is drawn from p. Each emitted token is then distributed
exactly as p, so speculation changes the speed, never the output distribution; greedy decoding
(p one-hot at the argmax) keeps the draft tokens that equal the model's argmax and emits the
same tokens as decoding one at a time.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup, n-grams of `ngram_min`..`ngram_max` tokens) or "draft"
    (a draft model, given to the engine); `num_tokens` guesses per step."""

    method: Literal["ngram", "draft"]
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"speculative tokens must be >= 1; got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max; got {self.ngram_min}, {self.ngram_max}")


def ngram_proposal(tokens: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt lookup: the up to `k` tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, trying the longest n first; [] when no tail recurs."""
    length = len(tokens)
    if k < 1:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        tail = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):  # latest first; the tail itself is excluded
            if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + k])
    return []


def accept_greedy(target_tokens: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """Greedy verification: `target_tokens` are the model's argmax after each prefix (one more
    than `draft_tokens`); returns the draft tokens that match, then the model's next token."""
    kept = 0
    while kept < len(draft_tokens) and draft_tokens[kept] == target_tokens[kept]:
        kept += 1
    return list(draft_tokens[:kept]) + [int(target_tokens[kept])]


def accept_sampled(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The speculative acceptance rule. `target_probs` (m + 1, vocab): the model's distribution
    after each prefix of the m `draft_tokens`; `draft_probs` (m, vocab): the distributions the
    draft tokens were drawn from, or None for a deterministic proposal (a point mass, as prompt
    lookup's). Returns the kept draft tokens and one token drawn by the rule."""
    device = target_probs.device
    for j, token in enumerate(draft_tokens):
        p = target_probs[j]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[j]
        if float(torch.rand((), generator=generator, device=device)) * float(q[token]) < float(p[token]):
            continue
        residual = (p - q).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else p  # p == q up to rounding
        return list(draft_tokens[:j]) + [int(torch.multinomial(residual, 1, generator=generator))]
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return list(draft_tokens) + [int(bonus)]
