"""Vectorized MinHash over word n-gram shingles, and LSH band keys.

Everything runs as numpy array operations over a batch of documents; no Python loop touches a
word or a shingle:
1. the batch is lower-cased and joined into one array of Unicode code points (UTF-32);
2. a word is a maximal run of letters, digits, marks, '_' and other symbols; spaces (including
   non-breaking and ideographic ones) and punctuation (including typographic quotes and dashes,
   CJK and full-width punctuation) separate words, so shingles do not depend on the normalize
   stage. A character of a script written without spaces (Chinese, Japanese, Thai, Lao, Khmer,
   Burmese) is a word by itself: such text is shingled in character n-grams, mixed text in both;
3. a word's hash mixes its 8-byte blocks (two code points, read straight from the array through an
   unaligned strided view, the code points past its end masked off) with its length;
4. a shingle of n consecutive words (within one document) is a mixed linear combination of their
   hashes; a document with fewer than n words has one shingle of all its words;
5. permutation i is x -> a_i * x + b_i mod 2^64 (a_i odd, so a bijection); the signature is the
   minimum over the document's shingles (`np.minimum.reduceat`), computed over groups of whole
   documents of about `chunk` shingles so the working arrays stay in cache.
"""

import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from llmstack.errors import UserError

from .languages import UNSEGMENTED

_U64 = np.uint64
_MAX = np.iinfo(np.uint64).max
_GOLDEN = _U64(0x9E3779B97F4A7C15)
SEPARATOR, WORD, ALONE = 0, 1, 2


def _character_classes() -> npt.NDArray[np.int8]:
    """Class of every code point of the Basic Multilingual Plane; index 0x10000 stands for all above
    it (emoji, rare CJK): word characters."""
    classes = np.full(0x10001, WORD, dtype=np.int8)
    for cp in range(0x10000):
        category = unicodedata.category(chr(cp))
        if category[0] in "ZP" or category in ("Cc", "Cf", "Cs") and cp != 0x200D:
            classes[cp] = SEPARATOR
    classes[ord("_")] = WORD
    for lo, hi in zip(UNSEGMENTED[0::3], UNSEGMENTED[2::3]):  # "a-bc-d...": ranges of three characters
        block = np.arange(ord(lo), ord(hi) + 1)
        classes[block[classes[block] == WORD]] = ALONE
    return classes


_CLASSES = _character_classes()


def mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finalizer: a bijection on uint64 whose output bits all depend on all input bits."""
    x = x ^ (x >> _U64(30))
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def word_hashes(texts: Sequence[str]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
    """64-bit hashes of the words of `texts` (all documents, in order) and each document's word count."""
    hashes, words_per_doc, _ = word_spans(texts)
    return hashes, words_per_doc


def word_spans(
    texts: Sequence[str],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """`word_hashes` and, per word, its [start, end) in its lower-cased document (characters;
    shape (2, words))."""
    lowered = [t.lower() for t in texts]
    joined = "\n".join(lowered) + "\0\0"  # padding: every 2-code-point block read stays inside
    data = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    classes = _CLASSES[np.minimum(data[:-2], 0x10000)]
    is_word, alone = classes != SEPARATOR, classes == ALONE
    boundary = np.ones(len(classes) + 1, dtype=bool)  # boundary[i]: a word cannot continue from i-1 into i
    boundary[1:-1] = ~is_word[:-1] | ~is_word[1:] | alone[:-1] | alone[1:]
    starts = np.flatnonzero(is_word & boundary[:-1])
    ends = np.flatnonzero(is_word & boundary[1:]) + 1
    lengths = ends - starts
    blocks = (lengths + 1) // 2
    first_block = np.cumsum(blocks) - blocks
    block_index = np.arange(blocks.sum()) - np.repeat(first_block, blocks)
    positions = np.repeat(starts, blocks) + 2 * block_index
    every_offset = np.ndarray((len(data) - 1,), dtype="<u8", buffer=data, strides=(4,))
    values = every_offset[positions]
    tail = np.minimum(np.repeat(ends, blocks) - positions, 2).astype(np.uint64)  # code points of the word in the block
    values &= _MAX >> (_U64(32) * (_U64(2) - tail))
    with np.errstate(over="ignore"):
        mixed = mix64(values ^ (block_index.astype(np.uint64) * _GOLDEN))
        summed: npt.NDArray[np.uint64] = np.add.reduceat(mixed, first_block) if len(mixed) > len(starts) else mixed
        hashes = mix64(summed ^ lengths.astype(np.uint64))
    doc_starts = np.cumsum([0] + [len(t) + 1 for t in lowered[:-1]])
    words_per_doc = np.diff(np.searchsorted(starts, doc_starts), append=len(starts))
    offsets = np.repeat(doc_starts, words_per_doc)
    return hashes, words_per_doc, np.stack([starts - offsets, ends - offsets])


def shingle_hashes(texts: Sequence[str], ngram: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
    """Hashes of each document's word n-grams, concatenated, and each document's shingle count."""
    return combine_shingles(*word_hashes(texts), ngram)


def combine_shingles(
    words: npt.NDArray[np.uint64], words_per_doc: npt.NDArray[np.intp], ngram: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
    """Hashes of the word n-grams of documents given by their word hashes and word counts (the
    shingle of document d's n-gram at word k is its k-th); a document with fewer than `ngram`
    words has one shingle of them all."""
    doc = np.repeat(np.arange(len(words_per_doc)), words_per_doc)
    first_word = np.cumsum(words_per_doc) - words_per_doc
    combined = np.zeros(len(words), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(ngram):
            same_doc = doc[k:] == doc[: len(doc) - k]
            coefficient = _U64(2 * k + 1) * _GOLDEN
            combined[: len(doc) - k] += np.where(same_doc, words[k:] * coefficient, _U64(0))
        shingles = mix64(combined)
    position = np.arange(len(words)) - np.repeat(first_word, words_per_doc)
    per_doc = np.maximum(words_per_doc - ngram + 1, np.minimum(words_per_doc, 1))
    keep = position < np.repeat(per_doc, words_per_doc)
    return shingles[keep], per_doc


class MinHasher:
    """MinHash signatures of `num_perm` 64-bit hashes and LSH keys of `bands` bands of
    `num_perm // bands` rows (defaults: 112 = 14 x 8, word 5-grams, seed 42)."""

    def __init__(
        self,
        num_perm: int = 112,
        bands: int = 14,
        ngram: int = 5,
        seed: int = 42,
        chunk: int = 65536,
        batch_chars: int = 4_000_000,
    ) -> None:
        if num_perm % bands:
            raise UserError(f"minhash: num_perm ({num_perm}) must be a multiple of bands ({bands})")
        self.num_perm, self.bands, self.rows, self.ngram = num_perm, bands, num_perm // bands, ngram
        self.chunk, self.batch_chars = chunk, batch_chars
        rng = np.random.Generator(np.random.PCG64(seed))
        self.a = rng.integers(0, _MAX, num_perm, dtype=np.uint64, endpoint=True) | _U64(1)
        self.b = rng.integers(0, _MAX, num_perm, dtype=np.uint64, endpoint=True)

    def signatures(self, texts: Iterable[str]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
        """(len(texts), num_perm) uint64 signatures, and `has_shingles`: False for a document
        without words, whose signature (all max values) must not take part in LSH. Documents are
        hashed in batches of about `batch_chars` characters."""
        texts = list(texts)
        batches, start, size = [], 0, 0
        for i, text in enumerate(texts):
            size += len(text)
            if size >= self.batch_chars or i == len(texts) - 1:
                batches.append(self._signatures(texts[start : i + 1]))
                start, size = i + 1, 0
        if not batches:
            return np.empty((0, self.num_perm), dtype=np.uint64), np.empty(0, dtype=bool)
        return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])

    def _signatures(self, texts: Sequence[str]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
        shingles, per_doc = shingle_hashes(texts, self.ngram)
        signatures = np.full((len(per_doc), self.num_perm), _MAX, dtype=np.uint64)
        docs = np.flatnonzero(per_doc)
        ends = np.cumsum(per_doc[docs])
        offsets = ends - per_doc[docs]
        buffer = np.empty(max(self.chunk, int(per_doc.max(initial=0))), dtype=np.uint64)
        lo = 0
        while lo < len(docs):  # a group of whole documents with about `chunk` shingles
            hi = max(int(np.searchsorted(ends, offsets[lo] + self.chunk, side="right")), lo + 1)
            group = shingles[offsets[lo] : ends[hi - 1]]
            starts = offsets[lo:hi] - offsets[lo]
            work = buffer[: len(group)]
            out = signatures[docs[lo:hi]]
            with np.errstate(over="ignore"):
                for i in range(self.num_perm):
                    np.multiply(group, self.a[i], out=work)
                    work += self.b[i]
                    out[:, i] = np.minimum.reduceat(work, starts)
            signatures[docs[lo:hi]] = out
            lo = hi
        return signatures, per_doc > 0

    def band_keys(self, signatures: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """(n, bands) uint64: one hash of each band's rows; equal keys make candidate pairs."""
        rows = signatures.reshape(len(signatures), self.bands, self.rows)
        keys = np.full(rows.shape[:2], _U64(self.rows), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for r in range(self.rows):
                keys = mix64(keys ^ rows[:, :, r])
        return keys


def estimated_jaccard(sig_a: npt.NDArray[np.uint64], sig_b: npt.NDArray[np.uint64]) -> float:
    return float(np.mean(sig_a == sig_b))
