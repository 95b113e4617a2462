"""Document boundaries inside packed samples (`data.document_masking`).

A packed sample of `seq_len` input positions holds the ends and starts of several documents. Its
boundaries come from what packing stored, never from the tokens: a packed shard's index holds
every document's offset, and a stream knows where each document it appended begins. (EOS cannot
mark them: a text that contains the EOS token's string tokenizes to that id inside a document.)

`starts[p]` is True where input position p begins a document; position 0 always does (a sample
that begins mid-document starts that document's visible part there, as it would be trained alone
from its first token in the sample). From the starts a batch carries, per token:

    document_ids  the number of the document within its sample (0, 1, ...): attention stays inside one
    position_ids  the position within its document, restarting at 0 at each start (RoPE's positions)

The target of a document's last input position (its EOS) is the next document's first token, as
without masking; it is predicted from its own document alone.
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch


def block_starts(document_offsets: npt.NDArray[np.int64], start: int, seq_len: int) -> npt.NDArray[np.bool_]:
    """The document starts of the `seq_len` input positions from token `start` of a shard whose
    documents begin at the sorted token offsets `document_offsets`."""
    starts = np.zeros(seq_len, dtype=bool)
    lo, hi = np.searchsorted(document_offsets, [start, start + seq_len])
    starts[np.asarray(document_offsets[lo:hi], dtype=np.int64) - start] = True
    starts[0] = True
    return starts


def run_starts(lengths: Sequence[int], seq_len: int) -> npt.NDArray[np.bool_]:
    """The document starts of `seq_len` input positions filled by documents (or a document's
    remaining tail, first) of `lengths` tokens, in order."""
    starts = np.zeros(seq_len, dtype=bool)
    starts[0] = True
    position = 0
    for length in lengths:
        position += int(length)
        if position >= seq_len:
            break
        starts[position] = True
    return starts


def document_fields(starts: npt.NDArray[np.bool_]) -> dict[str, torch.Tensor]:
    """{"position_ids", "document_ids"} (int64, the shape of `starts`: (batch, seq_len)) of a
    batch's document starts."""
    starts = np.array(starts, dtype=bool, copy=True)
    starts[..., 0] = True
    document_ids = np.cumsum(starts, axis=-1) - 1
    index = np.arange(starts.shape[-1])
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)  # each token's document's first position
    return {"position_ids": torch.from_numpy(index - first), "document_ids": torch.from_numpy(document_ids)}


def causal_batch(blocks: npt.NDArray[np.int64], starts: npt.NDArray[np.bool_]) -> dict[str, torch.Tensor]:
    """A document-masked batch of packed blocks (batch, seq_len + 1) and their starts (batch,
    seq_len): the model's keyword arguments {"input_ids", "shift_labels", "position_ids",
    "document_ids"}."""
    tokens = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))
    return {"input_ids": tokens[:, :-1], "shift_labels": tokens[:, 1:], **document_fields(starts)}
