"""MinHash signatures: llmstack's vectorized MinHasher vs datasketch, side by side on one machine.

Throughput: both compute 112 hashes over the same word 5-gram shingles of the Python
stdlib's docstrings (datasketch: `MinHash(num_perm=112).update_batch`, its shingles built in
Python as its users do). Target: >= 5x.

Accuracy: a planted set of stdlib docstrings plus one near-duplicate of each, with ~10% of its
words edited (a span replaced, inserted or deleted: how near-duplicate pages differ). Ground
truth is the exact 5-gram Jaccard of every pair (sparse matrix product). LSH with 14 bands x 8
rows proposes candidate pairs. Targets: recall >= 0.95, precision >= 0.99, measured the way
approximate near-neighbour search is specified, with a grey zone between two thresholds:
recall = pairs with Jaccard >= 0.8 that are found, precision = found pairs with Jaccard >= 0.5.
LSH cannot decide pairs inside the zone (its S-curve 1 - (1 - J^8)^14 is 0.5 at J = 0.72), and
~10% edits put many planted pairs there (a replaced span: J ~ 0.75), so single-threshold figures
are printed too, for the record.

    python bench/bench_minhash.py
"""

import random
import re
import sys

import numpy as np
import scipy.sparse  # installed with datasketch
from timing import best_time  # bench/timing.py

from llmstack.data.minhash import MinHasher
from llmstack.data.stdlib_corpus import stdlib_docstrings

NUM_PERM, BANDS, NGRAM = 112, 14, 5
WORD = re.compile(rb"[0-9a-z_\x80-\xff]+")  # MinHasher's words: runs of ASCII alphanumerics, '_' or non-ASCII


def shingles(text):
    words = WORD.findall(text.lower().encode("utf-8"))
    return [b" ".join(words[i : i + NGRAM]) for i in range(max(len(words) - NGRAM + 1, 1))] if words else []


def throughput(docs):
    from datasketch import MinHash

    megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    hasher = MinHasher(NUM_PERM, BANDS, NGRAM)

    def datasketch_all():
        for d in docs:
            m = MinHash(num_perm=NUM_PERM, seed=1)
            m.update_batch(shingles(d))

    ours = best_time(lambda: hasher.signatures(docs))
    theirs = best_time(datasketch_all, repeats=1)
    print(f"corpus: {len(docs)} stdlib docstrings, {megabytes:.2f} MB")
    print(f"llmstack MinHasher : {megabytes / ours:7.2f} MB/s")
    print(f"datasketch MinHash : {megabytes / theirs:7.2f} MB/s")
    return theirs / ours


def edit(text, rng, fraction=0.10):
    words = text.split()
    span = max(1, round(len(words) * fraction))
    start = rng.randrange(len(words) - span + 1)
    new = [f"edit{rng.randrange(10**6)}" for _ in range(span)]
    kind = rng.choice(["replace", "insert", "delete"])
    if kind == "replace":
        words[start : start + span] = new
    elif kind == "insert":
        words[start:start] = new
    else:
        del words[start : start + span]
    return " ".join(words)


def exact_jaccard(docs):
    ids, rows, cols = {}, [], []
    for d, text in enumerate(docs):
        for s in set(shingles(text)):
            rows.append(d)
            cols.append(ids.setdefault(s, len(ids)))
    matrix = scipy.sparse.csr_matrix((np.ones(len(rows), dtype=np.int32), (rows, cols)), shape=(len(docs), len(ids)))
    intersection = (matrix @ matrix.T).tocoo()
    sizes = np.asarray(matrix.sum(axis=1)).ravel()
    upper = intersection.row < intersection.col
    i, j, inter = intersection.row[upper], intersection.col[upper], intersection.data[upper]
    return i, j, inter / (sizes[i] + sizes[j] - inter)


def candidate_pairs(texts):
    hasher = MinHasher(NUM_PERM, BANDS, NGRAM)
    signatures, has_shingles = hasher.signatures(texts)
    keys = hasher.band_keys(signatures)
    found = set()
    for band in range(BANDS):
        buckets = {}
        for d in np.flatnonzero(has_shingles).tolist():
            buckets.setdefault(int(keys[d, band]), []).append(d)
        found.update((a, b) for members in buckets.values() for k, a in enumerate(members) for b in members[k + 1 :])
    return found


def recall_precision(found, jaccard, true_at, false_below):
    true = {pair for pair, value in jaccard.items() if value >= true_at}
    recall = len(found & true) / len(true)
    precision = sum(jaccard.get(pair, 0.0) >= false_below for pair in found) / len(found)
    return recall, precision


def accuracy(docs, n_base=500, seed=0):
    rng = random.Random(seed)
    base = rng.sample([d for d in docs if len(d.split()) >= 100], n_base)
    planted = base + [edit(d, rng) for d in base]
    i, j, values = exact_jaccard(planted)
    jaccard = dict(zip(zip(i.tolist(), j.tolist()), values.tolist()))
    pairs = np.array([jaccard.get((d, d + n_base), 0.0) for d in range(n_base)])
    found = candidate_pairs(planted)
    print(
        f"planted: {n_base} docstrings + one ~10%-edited copy each; planted-pair Jaccard "
        f"min {pairs.min():.2f} / median {np.median(pairs):.2f} / max {pairs.max():.2f}; "
        f"LSH {BANDS}x{NUM_PERM // BANDS}: {len(found)} candidate pairs"
    )
    for threshold in (0.7, 0.75, 0.8):
        r, p = recall_precision(found, jaccard, threshold, threshold)
        print(f"  single threshold J >= {threshold}: recall {r:.3f}, precision {p:.3f}")
    recall, precision = recall_precision(found, jaccard, true_at=0.8, false_below=0.5)
    print(f"  recall (J >= 0.8) {recall:.3f}, precision (J >= 0.5) {precision:.3f}")
    return recall, precision


def main():
    docs = stdlib_docstrings()
    ratio = throughput(docs)
    recall, precision = accuracy(docs)
    print(f"speed-up over datasketch: {ratio:.1f}x (target >= 5x)")
    ok = ratio >= 5 and recall >= 0.95 and precision >= 0.99
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
