"""Next-token selection as pure functions over a (batch, vocab) tensor of logits.

Each filter returns new logits with disallowed tokens set to -inf, so they compose in the usual
order: repetition penalty, temperature, top-k, top-p, then a draw from a seeded generator.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters; a
    repetition_penalty of 1.0 disables the penalty (CTRL, Keskar et al. 2019)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0; got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0; got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make tokens already seen (`seen`: boolean (batch, vocab)) less likely: positive logits are
    divided by `penalty`, negative ones multiplied, as in CTRL and Hugging Face."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept too)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2019): keep the smallest set of most likely tokens whose
    probability adds up to at least p. The most likely token is always kept."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def probabilities(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The (batch, vocab) distribution `next_token` draws from: after the repetition penalty
    (`seen`: boolean (batch, vocab)), temperature, top-k and top-p; one-hot at the argmax when
    greedy. Speculative decoding's acceptance rule compares these distributions."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = apply_temperature(logits, params.temperature)
    return top_p_filter(top_k_filter(logits, params.top_k), params.top_p).softmax(dim=-1)


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose one token per row. `seen` (boolean (batch, vocab)) feeds the repetition penalty."""
    probs = probabilities(logits, params, seen)
    if params.greedy:
        return probs.argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
