"""BERT's masked-LM corruption of packed token blocks, seeded per sample so that a resumed run
(on any number of ranks) masks every sample exactly as an uninterrupted one would.

Each token is selected with probability `probability` (0.15); a selected token becomes the mask
token with probability 0.8, a token drawn uniformly from the vocabulary with 0.1, and stays as
it is with 0.1. Special tokens (the EOS that separates packed documents) are never selected, as
in transformers' DataCollatorForLanguageModeling. The labels are the original tokens at the
selected positions and IGNORE_INDEX elsewhere, so the loss scores the selected tokens only.

The masking lives with the data, not in the training step: its random stream is a function of
(seed, global sample number) alone, so it needs no random state in checkpoints, does not depend
on the data-parallel layout, and evaluation masks the same positions on every run. Each epoch
masks a block afresh (its sample number differs), RoBERTa's dynamic masking.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .blocks import PackedBlocks
from .documents import document_fields
from .stream import MixtureStream

IGNORE_INDEX = -100  # label of positions the loss skips: torch's cross_entropy default, as llmstack.models'
MASK_FRACTION = 0.8  # of the selected tokens, replaced by the mask token
RANDOM_FRACTION = 0.1  # replaced by a random token; the rest stay unchanged
_STREAM = 0x4D4C4D  # keeps the masking's random stream apart from the shuffle's


def mask_tokens(
    tokens: npt.NDArray[np.int64],
    rng: np.random.Generator,
    mask_token_id: int,
    vocab_size: int,
    probability: float = 0.15,
    special_ids: Sequence[int] = (),
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(inputs, labels) of `tokens`: the corrupted tokens, and the originals at the selected
    positions (IGNORE_INDEX elsewhere); tokens in `special_ids` are never selected."""
    selected = (rng.random(tokens.shape) < probability) & ~np.isin(tokens, special_ids)
    action = rng.random(tokens.shape)
    to_mask = selected & (action < MASK_FRACTION)
    to_random = selected & (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)
    inputs = tokens.copy()
    inputs[to_mask] = mask_token_id
    inputs[to_random] = rng.integers(0, vocab_size, int(to_random.sum()))
    return inputs, np.where(selected, tokens, IGNORE_INDEX)


@dataclass(frozen=True)
class Masking:
    """The masking of a masked LM's samples: sample number n of a run is masked from a random
    stream seeded by (seed, n) alone, whatever the data source and the number of ranks."""

    mask_token_id: int
    vocab_size: int
    probability: float = 0.15
    seed: int = 0
    special_ids: tuple[int, ...] = ()

    def sample(self, block: npt.NDArray[np.int64], number: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(inputs, labels) of a packed block's first `seq_len` tokens (the decoder's extra target
        token is dropped), as sample `number`."""
        rng = np.random.default_rng([_STREAM, self.seed, number])
        return mask_tokens(block[:-1], rng, self.mask_token_id, self.vocab_size, self.probability, self.special_ids)

    @staticmethod
    def collate(samples: Sequence[tuple[npt.NDArray[Any], ...]]) -> dict[str, torch.Tensor]:
        """{"input_ids", "labels"} of (inputs, labels) samples; of (inputs, labels, document starts)
        samples (document masking), also their "position_ids" and "document_ids"."""
        inputs, labels, *starts = zip(*samples)
        batch = {"input_ids": torch.from_numpy(np.stack(inputs)), "labels": torch.from_numpy(np.stack(labels))}
        return {**batch, **document_fields(np.stack(starts[0]))} if starts else batch


class MaskedBlocks(PackedBlocks):
    """PackedBlocks for a masked LM: each sample is a block masked by `Masking` (never at
    `special_ids`: pass the tokenizer's `all_special_ids`). Batches are {"input_ids", "labels"}
    LongTensors (micro, seq_len), labels aligned with the inputs as Hugging Face's masked LMs take them."""

    def __init__(
        self,
        prefixes: str | Sequence[str | Path],
        seq_len: int,
        mask_token_id: int,
        vocab_size: int,
        probability: float = 0.15,
        seed: int = 0,
        shuffle: bool = True,
        special_ids: Sequence[int] = (),
        document_masking: bool = False,
    ) -> None:
        super().__init__(prefixes, seq_len, seed, shuffle, document_masking=document_masking)
        self.masking = Masking(mask_token_id, vocab_size, probability, seed, tuple(special_ids))

    def sample(self, i: int) -> tuple[npt.NDArray[Any], ...]:  # type: ignore[override]
        if not self.document_masking:
            return self.masking.sample(super().sample(i), i)
        tokens, starts = super().sample(i)
        return (*self.masking.sample(tokens, i), starts)

    def collate(self, samples: list) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.masking.collate(samples)


class MaskedStream(MixtureStream):
    """A streaming mixture (llmstack.data.stream) for a masked LM: data-parallel rank r's k-th
    block of the stream is sample k x dp_size + r, masked by `masking`; a resumed stream continues
    at the same k, so it masks as an uninterrupted one."""

    def __init__(self, *args: Any, masking: Masking, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.masking = masking

    def micro_batches(  # type: ignore[override]
        self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        k = consumed_samples // dp_size
        for batch in super().micro_batches(consumed_samples, micro_batch_size, dp_rank, dp_size):
            samples: list[tuple[npt.NDArray[Any], ...]]
            if isinstance(batch, dict):  # document masking: the masking reads the inputs only
                blocks, starts = batch["input_ids"], (batch["position_ids"] == 0).numpy()
                samples = [
                    (*self.masking.sample(np.append(block.numpy(), 0), n), s)
                    for block, s, n in zip(blocks, starts, self._numbers(k, len(blocks), dp_rank, dp_size))
                ]
            else:
                numbers = self._numbers(k, len(batch), dp_rank, dp_size)
                samples = [self.masking.sample(block.numpy(), n) for block, n in zip(batch, numbers)]
            yield self.masking.collate(samples)
            k += len(samples)

    @staticmethod
    def _numbers(k: int, count: int, dp_rank: int, dp_size: int) -> range:
        return range(k * dp_size + dp_rank, (k + count) * dp_size, dp_size)
