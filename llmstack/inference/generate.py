"""Autoregressive decoding with a KV cache, for batches of prompts of different lengths.

Prompts are left-padded so every row's next token sits in the last column. A padded row's
positions count only its real tokens (the cumulative sum of its attention mask), so a prompt
decodes the same alone or in a batch. Works with any causal LM that takes `cache=`,
`attention_mask`, `position_ids` and `logits_to_keep` (llmstack's model, transformers' Llama).
"""

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache
from transformers.generation import BaseStreamer

from .sampling import GREEDY, SamplingParams, next_token
from .text_stream import StopAwareStreamer, first_stop


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (input_ids, attention_mask), both (batch, longest prompt), padded left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


class StopStrings:
    """Says whether a completion has just produced one of the stop strings.

    Only the tail of the completion is decoded: a string of n characters is at most 4n UTF-8
    bytes, so it lies within the last 4n + 1 tokens the step it appears.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = 4 * max(len(s) for s in self.stop_strings) + 1

    def __call__(self, completion: list[int]) -> bool:
        tail = self.tokenizer.decode(completion[-self.window :])
        return any(s in tail for s in self.stop_strings)


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | Iterable[int] | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    streamer: BaseStreamer | StopAwareStreamer | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) and return the new tokens of each.

    A row ends at `max_new_tokens`, at an `eos_token_id` (an id or a list of ids; not included in
    the result) or once its text contains one of `stop_strings` (decoded with `tokenizer`; the
    token that completes the string is included). `streamer` follows transformers' streamer
    protocol (`put(tensor)`, `end()`), e.g. `TextStreamer(tokenizer, skip_prompt=True)`: it gets
    the prompt, then each step's tokens. `seed` makes sampling reproducible. `use_cache=False`
    recomputes the whole sequence every step (the reference the cache is tested against).
    """
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the completions")
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    is_stop = StopStrings(tokenizer, stop_strings) if stop_strings and tokenizer is not None else None
    device = model.device
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None

    input_ids, attention_mask = (t.to(device) for t in left_pad(prompts))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = input_ids.shape[0]
    seen = torch.zeros(batch, model.config.vocab_size, dtype=torch.bool, device=device)
    rows, cols = attention_mask.nonzero(as_tuple=True)
    seen[rows, input_ids[rows, cols]] = True
    completions: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    cache = DynamicCache(config=model.config) if use_cache else None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    was_training = model.training
    model.eval()
    try:
        step_ids, step_positions = input_ids, position_ids
        for _ in range(max_new_tokens):
            logits = model(
                step_ids,
                attention_mask=attention_mask,
                position_ids=step_positions,
                cache=cache,
                use_cache=use_cache,
                logits_to_keep=1,
            ).logits[:, -1]
            token = next_token(logits, sampling, seen, generator)
            seen[torch.arange(batch, device=device), token] = True
            if streamer is not None:
                streamer.put(token.cpu())
            for row, t in enumerate(token.tolist()):
                if done[row]:
                    continue
                if t in eos:
                    done[row] = True
                    continue
                completions[row].append(t)
                done[row] = is_stop is not None and is_stop(completions[row])
            if all(done):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            next_positions = position_ids[:, -1:] + 1
            position_ids = torch.cat([position_ids, next_positions], dim=1)
            if use_cache:
                step_ids, step_positions = token[:, None], next_positions
            else:
                step_ids, step_positions = torch.cat([step_ids, token[:, None]], dim=1), position_ids
    finally:
        model.train(was_training)
        if streamer is not None:
            streamer.end()
    return completions


def generate_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    stop_strings: Sequence[str] = (),
    **kwargs: Any,
) -> list[str]:
    """`generate` on strings: encodes the prompts, stops at the tokenizer's EOS unless
    `eos_token_id` says otherwise, and returns each completion's text cut before its first stop
    string."""
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    completions = generate(model, prompt_ids, stop_strings=stop_strings, tokenizer=tokenizer, **kwargs)
    texts = [cast(str, tokenizer.decode(c, skip_special_tokens=True)) for c in completions]
    return [text[: first_stop(text, stop_strings)] for text in texts]
