"""Megatron's indexed dataset format: token documents in `PREFIX.bin`, their index in `PREFIX.idx`.

`.bin` holds the tokens of every document back to back. `.idx` (version 1, "MMIDIDX"):

    magic b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B
    sequence count <Q | document count <Q
    sizes int32[sequences] | pointers int64[sequences] (byte offsets into .bin)
    document index int64[documents + 1] (sequence boundaries of documents)

Here one sequence is one document. Files are read through numpy memory maps, so a dataset of any
size opens instantly, and the same files load in Megatron-LM / Megatron-DeepSpeed.
"""

import os
import struct
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from llmstack.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def best_dtype(vocab_size: int) -> type[np.uint16 | np.int32]:
    """The smallest token dtype that holds every id of the vocabulary."""
    return np.uint16 if vocab_size <= 65536 else np.int32


class IndexedDatasetWriter:
    """Writes documents to `prefix.bin/.idx`. Files appear under their names only on `finalize()`,
    so an interrupted writer leaves no half-written dataset behind."""

    def __init__(self, prefix: str | Path, dtype: npt.DTypeLike = np.uint16) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._sizes: list[int] = []
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin_tmp = f"{self.prefix}.bin.tmp"
        self._bin = open(self._bin_tmp, "wb")

    def add_document(self, tokens: npt.ArrayLike) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < np.iinfo(self.dtype).min or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids out of range for {self.dtype}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(tokens.size)

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        idx_tmp = f"{self.prefix}.idx.tmp"
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(idx_tmp, f"{self.prefix}.idx")

    def abort(self) -> None:
        self._bin.close()
        os.remove(self._bin_tmp)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort() if exc_type else self.finalize()


class IndexedDataset:
    """Read-only view of `prefix.bin/.idx`: `ds[i]` is document i's tokens, `ds.tokens` all of them."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        for ext in (".idx", ".bin"):
            if not os.path.exists(self.prefix + ext):
                raise UserError(
                    f"indexed dataset file {self.prefix + ext} not found; "
                    "prepare the data first (llmstack data pack) or fix the path in the run config"
                )
        with open(self.prefix + ".idx", "rb") as f:
            header = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if header[: len(MAGIC)] != MAGIC:
            raise UserError(f"{self.prefix}.idx is not a Megatron indexed dataset index (bad magic bytes)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION or code not in DTYPES:
            raise UserError(f"{self.prefix}.idx has unsupported version {version} or dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        idx = np.memmap(self.prefix + ".idx", mode="r", dtype=np.uint8)
        offset = len(header)
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=offset)
        expected = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        actual = os.path.getsize(self.prefix + ".bin")
        if actual != expected:
            raise UserError(
                f"{self.prefix}.bin has {actual} bytes but its index describes {expected}; "
                "the dataset is truncated or corrupt: pack it again"
            )
        self.tokens = (
            np.memmap(self.prefix + ".bin", mode="r", dtype=self.dtype) if expected else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> npt.NDArray[Any]:
        start = self.pointers[i] // self.dtype.itemsize
        return self.tokens[start : start + self.sizes[i]]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)
