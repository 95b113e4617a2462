"""T5's span corruption of packed token blocks, seeded per sample so that a resumed run (on any
number of ranks) corrupts every sample exactly as an uninterrupted one would.

`random_spans_noise_mask` is T5's (Raffel et al., 2020; t5.data.preprocessors): of a block's n
tokens round(n x noise_density) are noise, in round(noise / mean_noise_span_length) spans, the
noise and the kept tokens each cut into that many non-empty runs at random and interleaved, kept
run first. The encoder reads the kept tokens with each noise span replaced by one sentinel
(`<extra_id_k>` for span k); the decoder's targets are each sentinel followed by the span it
replaced, then EOS (which also ends the inputs):

    tokens   a b c d e f g h        inputs   a <extra_id_0> d e <extra_id_1> h EOS
    noise        ^       ^ ^        targets  <extra_id_0> b c <extra_id_1> f g EOS

The span counts depend on n alone, so every sample of a run has the same input and target
lengths: batches need no padding. `span_ids` number each target's span (the sentinel with its
tokens; -1 for the final EOS), for exact-span accuracy (llmstack.models.loss.span_predictions).
As with the masked LM (llmstack.data.mlm), the random stream is a function of (seed, global
sample number) alone: no random state in checkpoints, and every epoch corrupts a block afresh.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from llmstack.errors import UserError

from .blocks import PackedBlocks
from .tokenizer import SENTINEL_TOKEN

_STREAM = 0x5350414E  # keeps the corruption's random stream apart from the shuffle's and the masked LM's


def span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a block of `length` tokens, as T5 computes them."""
    noise = min(max(round(length * noise_density), 1), length - 1)
    return noise, max(round(noise / mean_noise_span_length), 1)


def random_segmentation(items: int, segments: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Lengths of a uniformly random cut of `items` into `segments` non-empty runs."""
    cuts = np.sort(rng.choice(np.arange(1, items), segments - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [items]]))


def random_spans_noise_mask(
    length: int, noise_density: float, mean_noise_span_length: float, rng: np.random.Generator
) -> npt.NDArray[np.bool_]:
    """T5's noise mask of `length` tokens: True at the noise tokens, which come in spans between
    runs of kept tokens, the first run kept."""
    noise, spans = span_counts(length, noise_density, mean_noise_span_length)
    noise_lengths = random_segmentation(noise, spans, rng)
    kept_lengths = random_segmentation(length - noise, spans, rng)
    runs = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


def corrupt_spans(
    tokens: npt.NDArray[np.int64], noise: npt.NDArray[np.bool_], sentinel_ids: Sequence[int], eos_id: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(inputs, targets, span_ids) of `tokens` under the noise mask (see the module docstring)."""
    starts = noise & ~np.concatenate([[False], noise[:-1]])  # the first token of each noise span
    span = np.cumsum(starts) - 1  # each token's span number
    sentinels = np.asarray(sentinel_ids, dtype=np.int64)
    inputs = np.where(starts, sentinels[span.clip(0)], tokens)[~noise | starts]
    noise_span = span[noise]
    first = np.flatnonzero(starts[noise])  # where each span begins among the noise tokens
    targets = np.insert(tokens[noise], first, sentinels[noise_span[first]])
    span_ids = np.insert(noise_span, first, noise_span[first])
    eos = np.array([eos_id], dtype=np.int64)
    return np.concatenate([inputs, eos]), np.concatenate([targets, eos]), np.concatenate([span_ids, [-1]])


@dataclass(frozen=True)
class SpanCorruption:
    """The corruption of a run's samples: sample number n is corrupted from a random stream seeded
    by (seed, n) alone, whatever the data source and the number of ranks."""

    sentinel_ids: tuple[int, ...]
    eos_id: int
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    seed: int = 0

    def check(self, length: int) -> None:
        """Refuse blocks of `length` tokens that need more sentinels than the tokenizer has."""
        spans = span_counts(length, self.noise_density, self.mean_noise_span_length)[1]
        if spans > len(self.sentinel_ids):
            raise UserError(
                f"span corruption of {length}-token blocks makes {spans} spans, and the tokenizer has "
                f"{len(self.sentinel_ids)} sentinel tokens: train one with `llmstack data train-tokenizer "
                f"--sentinels {spans}` or more, or shorten data.seq_len"
            )

    def sample(
        self, block: npt.NDArray[np.int64], number: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(inputs, targets, span_ids) of a packed block's first `seq_len` tokens (the decoder-only
        model's extra target token is dropped), as sample `number`."""
        tokens = block[:-1]
        rng = np.random.default_rng([_STREAM, self.seed, number])
        noise = random_spans_noise_mask(len(tokens), self.noise_density, self.mean_noise_span_length, rng)
        return corrupt_spans(tokens, noise, self.sentinel_ids, self.eos_id)

    @staticmethod
    def collate(samples: Sequence[tuple[npt.NDArray[Any], ...]]) -> dict[str, torch.Tensor]:
        """{"input_ids", "labels", "span_ids"}: the encoder's inputs, the decoder's targets and their spans."""
        names = ("input_ids", "labels", "span_ids")
        return {name: torch.from_numpy(np.stack(column)) for name, column in zip(names, zip(*samples))}


def sentinel_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of the tokenizer's sentinels `<extra_id_0>`, `<extra_id_1>`, ... (up to the first missing)."""
    vocab = tokenizer.get_vocab()
    ids: list[int] = []
    while SENTINEL_TOKEN.format(len(ids)) in vocab:
        ids.append(int(vocab[SENTINEL_TOKEN.format(len(ids))]))
    return tuple(ids)


class SpanCorruptedBlocks(PackedBlocks):
    """PackedBlocks for an encoder-decoder: each sample is a block corrupted by `SpanCorruption`;
    batches are SpanCorruption.collate's."""

    def __init__(
        self, prefixes: str | Sequence[str | Path], seq_len: int, corruption: SpanCorruption, shuffle: bool = True
    ) -> None:
        corruption.check(seq_len)
        super().__init__(prefixes, seq_len, corruption.seed, shuffle)
        self.corruption = corruption

    def sample(self, i: int) -> tuple[npt.NDArray[Any], ...]:  # type: ignore[override]
        return self.corruption.sample(super().sample(i), i)

    def collate(self, samples: list) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.corruption.collate(samples)
