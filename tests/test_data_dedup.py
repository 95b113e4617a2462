"""MinHash hashing against a plain-Python reference, LSH near-duplicate detection, exact and
paragraph dedup, and the disk-backed (many key ranges) path giving the in-memory answer."""

import random
import re

import numpy as np

from llmstack.data.dedup import (
    EXACT_DUPLICATE,
    KEEP,
    NEAR_DUPLICATE,
    PARAGRAPH_BITS,
    UnionFind,
    document_duplicates,
    duplicate_paragraphs,
    write_shard_keys,
)
from llmstack.data.minhash import MinHasher, shingle_hashes, word_hashes


def random_docs(n, words=120, seed=0):
    rng = random.Random(seed)
    vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(3000)]
    return [" ".join(rng.choices(vocab, k=words)) for _ in range(n)]


def edit_span(text, fraction, seed):
    """Replace one contiguous run of `fraction` of the words (a rewritten sentence)."""
    rng = random.Random(seed)
    words = text.split()
    span = int(len(words) * fraction)
    start = rng.randrange(len(words) - span)
    words[start : start + span] = [f"edit{rng.randrange(10**9)}" for _ in range(span)]
    return " ".join(words)


def shingle_set(text, n=5):
    words = re.findall(rb"[0-9a-z_\x80-\xff]+", text.lower().encode())
    return {tuple(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))}


def jaccard(a, b):
    a, b = shingle_set(a), shingle_set(b)
    return len(a & b) / len(a | b)


def test_words_hash_the_same_anywhere_and_split_like_the_reference():
    texts = ["Hello, WORLD! héllo_there x1", "", "world hello"]
    hashes, per_doc = word_hashes(texts)
    assert per_doc.tolist() == [4, 0, 2]
    assert hashes[1] == hashes[4] and hashes[0] == hashes[5] and len(set(hashes.tolist())) == 4
    assert word_hashes(["İSTANBUL a", "b c"])[1].tolist() == [2, 2]  # lower() makes "İ" longer
    long_words = ["a" * 20 + "b", "a" * 20 + "c", "a" * 21]  # differ only in their last 8-byte block
    assert len(set(word_hashes(long_words)[0].tolist())) == 3


def test_shingles_are_consecutive_word_ngrams_within_a_document():
    one, per_doc = shingle_hashes(["a b c d e f"], 5)
    parts, _ = shingle_hashes(["a b c d e", "b c d e f"], 5)
    assert per_doc.tolist() == [2] and one.tolist() == parts.tolist()
    short, per_doc = shingle_hashes(["a b", "", "x y z w v u"], 5)
    assert per_doc.tolist() == [1, 0, 2] and len(short) == 3
    assert short[0] != shingle_hashes(["a"], 5)[0][0]


def test_signatures_equal_a_plain_python_minhash():
    hasher = MinHasher(num_perm=16, bands=4, chunk=7)  # tiny groups: documents straddle every boundary
    texts = random_docs(12, words=9) + ["", "a b c"] + random_docs(3, words=30, seed=1)
    signatures, has_shingles = hasher.signatures(texts)
    shingles, per_doc = shingle_hashes(texts, 5)
    offsets = np.cumsum(per_doc) - per_doc
    for d in range(len(texts)):
        mine = [int(s) for s in shingles[offsets[d] : offsets[d] + per_doc[d]]]
        expected = [
            min(((int(a) * x + int(b)) % 2**64 for x in mine), default=2**64 - 1) for a, b in zip(hasher.a, hasher.b)
        ]
        assert signatures[d].tolist() == expected and has_shingles[d] == bool(mine)
    batched, _ = MinHasher(num_perm=16, bands=4, batch_chars=50).signatures(texts)
    assert np.array_equal(batched, signatures)


def test_estimated_jaccard_is_unbiased():
    docs = random_docs(60, words=200)
    edited = [edit_span(d, 0.15, seed=i) for i, d in enumerate(docs)]
    signatures, _ = MinHasher().signatures(docs + edited)
    errors = [np.mean(signatures[i] == signatures[60 + i]) - jaccard(docs[i], edited[i]) for i in range(60)]
    assert abs(np.mean(errors)) < 0.02 and np.std(errors) < 0.07  # binomial std at J~0.7 and 112 hashes: 0.043


def write_shards(tmp_path, shards, **options):
    """Key tables of consecutive shards; returns the (prefix, offset) lists dedup reads."""
    tables, offset = {"exact": [], "lsh": [], "paragraphs": []}, 0
    for s, texts in enumerate(shards):
        prefix = tmp_path / f"shard-{s}"
        write_shard_keys(prefix, texts, **options)
        for kind in tables:
            shift = PARAGRAPH_BITS if kind == "paragraphs" else 0
            tables[kind].append((f"{prefix}.{kind}", offset << shift))
        offset += len(texts)
    return tables, offset


def test_exact_and_near_duplicates_across_shards_in_memory_and_on_disk(tmp_path):
    base = random_docs(30, words=150)
    near = [edit_span(base[i], 0.02, seed=i) for i in range(10)]
    assert min(jaccard(base[i], near[i]) for i in range(10)) > 0.9  # LSH misses such a pair with p < 2e-4
    exact = [base[10].upper(), "  " + base[11].replace(" ", "\n  ")]
    shards = [base[:12] + [""], exact + near[:5], near[5:] + base[12:]]
    tables, n_docs = write_shards(tmp_path, shards, hasher=MinHasher())
    expected = np.full(n_docs, KEEP)
    expected[13:15] = EXACT_DUPLICATE
    expected[15:25] = NEAR_DUPLICATE
    for max_in_memory in (10**9, 16):  # one key range in memory; dozens of ranges over the files
        status = document_duplicates(n_docs, tables["exact"], tables["lsh"], bands=14, max_in_memory=max_in_memory)
        assert status.tolist() == expected.tolist()


def test_near_duplicate_detection_can_be_switched_off(tmp_path):
    base = random_docs(3)
    tables, n_docs = write_shards(tmp_path, [base + [edit_span(base[0], 0.05, 0), base[1]]])
    assert document_duplicates(n_docs, tables["exact"]).tolist() == [KEEP] * 4 + [EXACT_DUPLICATE]


def test_paragraph_dedup_keeps_first_occurrence(tmp_path):
    boiler = "Subscribe to our newsletter for more stories like this one."
    shards = [["Intro one.\n\n" + boiler, "short\n\nshort"], ["Intro two.\n\n" + boiler + "\n\nEnd.\n\n" + boiler]]
    tables, _ = write_shards(tmp_path, shards, exact=False, paragraph_min_chars=20)
    removed = duplicate_paragraphs(tables["paragraphs"], max_in_memory=2)
    assert removed.tolist() == [(2 << PARAGRAPH_BITS) | 1, (2 << PARAGRAPH_BITS) | 3]


def test_union_find_roots_are_smallest_members():
    clusters = UnionFind(6)
    clusters.union_pairs(np.array([5, 3, 4]), np.array([3, 1, 0]))
    assert clusters.roots().tolist() == [0, 1, 2, 1, 0, 1]
