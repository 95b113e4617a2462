"""Corpus-wide deduplication from per-shard key tables on disk.

Each shard writes, next to its documents, tables of (key, value) pairs sorted by key: the exact
hash of each document's normalized text, its MinHash LSH band keys (one table row per band) and,
for paragraph dedup, the hash of each paragraph. Finding duplicates is then a sort-merge: the
64-bit key space is cut into ranges small enough to hold `max_in_memory` pairs; for each range
every shard's slice is found by binary search in its memory-mapped table, and the slices are
concatenated and sorted. Equal keys become adjacent, and equal keys are duplicate candidates.
With one range this is the in-memory path; with more it is the same code over bucket files, so
the signatures of a corpus never need to fit in memory at once (only one band's keys of one range).

Documents connected by an equal key (exact hash or any LSH band) form clusters (union-find);
each cluster keeps its first document in corpus order.
"""

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .atomic import atomic_path

if TYPE_CHECKING:
    from .minhash import MinHasher

KEEP, EXACT_DUPLICATE, NEAR_DUPLICATE = 0, 1, 2
PARAGRAPH_BITS = 20  # a paragraph's position is (document << PARAGRAPH_BITS) | paragraph index


def text_hash(text: str) -> int:
    """64-bit hash of the text with case and whitespace differences removed."""
    normalized = " ".join(text.lower().split()).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(normalized, digest_size=8).digest(), "little")


def split_paragraphs(text: str) -> list[str]:
    return text.split("\n\n")


def write_shard_keys(
    prefix: str | Path,
    texts: list[str],
    exact: bool = True,
    hasher: "MinHasher | None" = None,
    paragraph_min_chars: int | None = None,
    include: npt.ArrayLike | None = None,
) -> None:
    """Write the key tables of one shard's documents (local indices 0..len(texts)-1): `.exact`
    (text hashes), `.lsh` (one row per band; documents without words are left out) and
    `.paragraphs` (hashes of paragraphs of at least `paragraph_min_chars` characters). Documents
    whose `include` flag is false get no keys: dedup never pairs them."""
    include = np.ones(len(texts), dtype=bool) if include is None else np.asarray(include, dtype=bool)
    indices = np.flatnonzero(include)
    if exact:
        write_key_table(f"{prefix}.exact", [[text_hash(texts[i]) for i in indices]], indices)
    if hasher is not None:
        signatures, has_shingles = hasher.signatures(texts[i] for i in indices)
        keys = hasher.band_keys(signatures[has_shingles])
        write_key_table(f"{prefix}.lsh", keys.T, indices[has_shingles])
    if paragraph_min_chars is not None:
        hashes, positions = [], []
        for i in indices.tolist():
            text = texts[i]
            for j, paragraph in enumerate(split_paragraphs(text)):
                if len(paragraph) >= paragraph_min_chars:
                    hashes.append(text_hash(paragraph))
                    positions.append((i << PARAGRAPH_BITS) | j)
        write_key_table(f"{prefix}.paragraphs", [hashes], np.array(positions, dtype=np.uint64))


def write_key_table(prefix: str, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
    """Save `keys` ((rows, n) uint64), each row sorted, with `values` ((n,) uint64) in the same order."""
    keys = np.asarray(keys, dtype=np.uint64)
    order = np.argsort(keys, axis=1, kind="stable")
    for suffix, array in (
        ("keys", np.take_along_axis(keys, order, axis=1)),
        ("values", np.asarray(values, dtype=np.uint64)[order]),
    ):
        with atomic_path(f"{prefix}.{suffix}.npy") as temp, open(temp, "wb") as f:
            np.save(f, array)


def _open_row(prefix: str, row: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    keys = np.load(f"{prefix}.keys.npy", mmap_mode="r")
    values = np.load(f"{prefix}.values.npy", mmap_mode="r")
    return keys[row], values[row]


def key_range(part: int, parts: int) -> tuple[int, int]:
    """[lo, hi) of the `part`-th of `parts` equal slices of the 64-bit key space."""
    return part * 2**64 // parts, (part + 1) * 2**64 // parts


def _slice(keys: npt.NDArray[np.uint64], lo: int, hi: int) -> tuple[int, int]:
    i = int(np.searchsorted(keys, np.uint64(lo)))
    j = int(np.searchsorted(keys, np.uint64(hi))) if hi < 2**64 else len(keys)
    return i, j


def sorted_runs(
    tables: Sequence[tuple[str, int]], row: int, max_in_memory: int, lo: int = 0, hi: int = 2**64
) -> Iterator[tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]:
    """Yield chunks (keys, values) of the pairs of `row` across `tables` ([(prefix, value_offset)],
    in corpus order) whose keys are in [lo, hi), each chunk sorted by key, with equal keys never
    split across chunks and values ascending among equal keys."""
    opened = [(*_open_row(prefix, row), np.uint64(offset)) for prefix, offset in tables]
    total = sum(j - i for i, j in (_slice(keys, lo, hi) for keys, _, _ in opened))
    chunks = max(1, math.ceil(total / max_in_memory))
    step = math.ceil((hi - lo) / chunks)
    for c in range(chunks):
        start, stop = lo + c * step, min(lo + (c + 1) * step, hi)
        key_parts, value_parts = [], []
        for keys, values, offset in opened:
            i, j = _slice(keys, start, stop)
            key_parts.append(keys[i:j])
            value_parts.append(values[i:j] + offset)
        keys, values = np.concatenate(key_parts), np.concatenate(value_parts)
        order = np.argsort(keys, kind="stable")  # stable: tables in corpus order stay in order
        yield keys[order], values[order]


def equal_key_pairs(
    keys: npt.NDArray[np.uint64], values: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(a, b) for consecutive pairs with equal keys in a sorted chunk: links every run into a chain."""
    same = keys[1:] == keys[:-1]
    return values[:-1][same], values[1:][same]


class UnionFind:
    """Disjoint sets over 0..n-1; a set's root is its smallest member."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def union_pairs(self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> None:
        if len(a):
            for x, y in np.unique(np.stack([a, b], axis=1), axis=0).tolist():
                self.union(x, y)

    def roots(self) -> npt.NDArray[np.int64]:
        parent = self.parent
        while True:
            grand = parent[parent]
            if np.array_equal(grand, parent):
                return parent
            parent = self.parent = grand


def duplicate_pairs(
    tables: Sequence[tuple[str, int]], rows: int, max_in_memory: int = 50_000_000, lo: int = 0, hi: int = 2**64
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(a, b) int64 arrays linking the documents that share a key in [lo, hi) in any of `rows` rows
    of `tables`; every group of equal keys becomes a chain of pairs."""
    firsts, seconds = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
    for row in range(rows if tables else 0):
        for keys, values in sorted_runs(tables, row, max_in_memory, lo, hi):
            a, b = equal_key_pairs(keys, values.astype(np.int64))
            firsts.append(a)
            seconds.append(b)
    return np.concatenate(firsts), np.concatenate(seconds)


def cluster_status(
    n_docs: int, exact_pairs: Iterable[npt.NDArray[np.int64]] | None, near_pairs: Iterable[npt.NDArray[np.int64]] | None
) -> npt.NDArray[np.int8]:
    """Status of every document (KEEP, EXACT_DUPLICATE or NEAR_DUPLICATE): exact clusters first,
    then the near pairs merge clusters; each final cluster keeps its first document. The answer
    depends on the pairs only, not on the key ranges or tasks that found them."""
    clusters = UnionFind(n_docs)
    status = np.zeros(n_docs, dtype=np.int8)
    for pairs, label in ((exact_pairs, EXACT_DUPLICATE), (near_pairs, NEAR_DUPLICATE)):
        if pairs is None:
            continue
        clusters.union_pairs(*pairs)
        not_first = clusters.roots() != np.arange(n_docs)
        status[not_first & (status == KEEP)] = label
    return status


def document_duplicates(
    n_docs: int,
    exact_tables: Sequence[tuple[str, int]] | None = None,
    lsh_tables: Sequence[tuple[str, int]] | None = None,
    bands: int = 0,
    max_in_memory: int = 50_000_000,
) -> npt.NDArray[np.int8]:
    """`cluster_status` of the pairs found over the whole key space, in one process."""
    exact = duplicate_pairs(exact_tables, 1, max_in_memory) if exact_tables else None
    near = duplicate_pairs(lsh_tables, bands, max_in_memory) if lsh_tables else None
    return cluster_status(n_docs, exact, near)


def duplicate_paragraphs(
    tables: Sequence[tuple[str, int]], max_in_memory: int = 50_000_000, lo: int = 0, hi: int = 2**64
) -> npt.NDArray[np.uint64]:
    """Sorted positions of paragraphs whose hash (in [lo, hi)) already occurred earlier in the corpus."""
    repeats = [np.empty(0, dtype=np.uint64)]
    for keys, values in sorted_runs(tables, 0, max_in_memory, lo, hi):
        repeats.append(values[1:][keys[1:] == keys[:-1]])
    return np.sort(np.concatenate(repeats))
