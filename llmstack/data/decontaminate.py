"""Decontamination: drop (or cut) training documents that share word n-grams with evaluation sets.

    stage = decontaminate(eval_sets=[{"name": "mmlu", "paths": "evals/mmlu/*.jsonl", "text_field": "question"}])
    llmstack data decontaminate --data 'clean/*.jsonl' --eval mmlu=evals/mmlu.jsonl --out decontaminated

As GPT-3 (Brown et al., 2020, appendix C) did: a training document that shares any 13-gram (by
default) with an evaluation example is contaminated. Words are those of the MinHash shingles
(`minhash.word_spans`): lower-cased runs of letters and digits, punctuation and spaces of every
script as separators, so case and punctuation do not hide an overlap; each character of a script
written without spaces (Chinese, Japanese, Thai, ...) is a word by itself, so such text is
compared in character n-grams and mixed text in both. An evaluation example shorter than n words
gives no n-gram and is counted as `short_examples`.

The index: every n-gram hash (64 bits) of every evaluation set with the set's number, sorted,
saved once to `index_dir` (keyed by the settings and the evaluation files' sizes and times) and
memory-mapped by each worker, so workers share one copy in the page cache. Training documents are
then streamed shard by shard through the pipeline's workers (`data clean` or `data decontaminate`):
the corpus never has to fit in memory, only the index (10 bytes an n-gram).

`mode: drop` (the default) drops a contaminated document. `mode: cut`, as GPT-3 did, removes each
matched n-gram and `window` characters on either side, keeps the remaining pieces of at least
`min_piece` characters (joined by blank lines) and drops the document when more than `max_pieces`
pieces would remain or none does. The stage counts, per evaluation set NAME, `contaminated:NAME`
(documents overlapping it) and `ngrams:NAME` (matched n-gram occurrences); the report's
counts give them per set.
"""

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from llmstack.errors import UserError

from .atomic import atomic_path
from .document import Document, Stage
from .minhash import combine_shingles, word_spans
from .mixture import source_names
from .reader import TEXT_UNITS, expand_paths, iter_documents

DEFAULT_NGRAM = 13  # GPT-3's
MODES = ("drop", "cut")
EVAL_SET_KEYS = ("text_field", "text_unit")
BATCH = 512  # documents hashed at a time while building the index


def default_index_dir() -> Path:
    """$LLMSTACK_CACHE_DIR/decontaminate, else ~/.cache/llmstack/decontaminate."""
    root = os.environ.get("LLMSTACK_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "llmstack") / "decontaminate"


class EvalIndex:
    """The sorted n-gram hashes of evaluation sets and, for each, the set it came from."""

    def __init__(
        self, hashes: npt.NDArray[np.uint64], sets: npt.NDArray[np.uint16], names: Sequence[str], n: int
    ) -> None:
        self.hashes, self.sets, self.names, self.n = hashes, sets, list(names), n

    def matches(self, shingles: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.bool_], list[npt.NDArray[np.uint16]]]:
        """For each shingle whether the index holds it, and (for each matched one) its sets."""
        lo = np.searchsorted(self.hashes, shingles, side="left")
        hi = np.searchsorted(self.hashes, shingles, side="right")
        hit = hi > lo
        return hit, [np.asarray(self.sets[a:b]) for a, b in zip(lo[hit].tolist(), hi[hit].tolist())]

    def save(self, path: Path) -> None:
        with atomic_path(path) as temp, open(temp, "wb") as f:
            np.savez(f, hashes=self.hashes, sets=self.sets, names=np.array(self.names), n=self.n)

    @classmethod
    def load(cls, path: Path) -> "EvalIndex":
        data = np.load(path)
        return cls(data["hashes"], data["sets"], [str(x) for x in data["names"]], int(data["n"]))


def check_eval_sets(eval_sets: Any) -> list[str]:
    """The names of `eval_sets` ([{name, paths, text_field?, text_unit?}]), checked: one UserError
    saying what to fix."""
    if not isinstance(eval_sets, list):
        raise UserError(f"decontaminate: eval_sets must be a list of {{name, paths}}; got {eval_sets!r}")
    names = source_names(eval_sets, "paths", EVAL_SET_KEYS, "decontaminate: eval_sets")
    for spec in eval_sets:
        if spec.get("text_unit", "document") not in TEXT_UNITS:
            raise UserError(
                f"decontaminate: text_unit must be one of {', '.join(TEXT_UNITS)}; got {spec['text_unit']!r}"
            )
        expand_paths(spec["paths"])  # a pattern matching nothing is an error now, before any work
    return names


def document_ngrams(texts: Sequence[str], n: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]:
    """Hashes of the n-grams of each text (concatenated, in order) and each text's count; a text
    shorter than n words has none."""
    words, per_doc, _ = word_spans(texts)
    shingles, counts = combine_shingles(words, per_doc, n)
    full = per_doc >= n
    keep = np.repeat(full, counts)
    return shingles[keep], np.where(full, counts, 0)


def build_index(eval_sets: Sequence[Mapping[str, Any]], n: int = DEFAULT_NGRAM) -> tuple[EvalIndex, Counter]:
    """The index of `eval_sets` and what building it counted (examples and short_examples per set)."""
    names = check_eval_sets(list(eval_sets))
    parts: list[npt.NDArray[np.uint64]] = []
    set_ids: list[npt.NDArray[np.uint16]] = []
    counts: Counter = Counter()
    for number, (name, spec) in enumerate(zip(names, eval_sets)):
        texts = (
            d.text
            for d in iter_documents(spec["paths"], spec.get("text_field", "text"), spec.get("text_unit", "document"))
        )
        while batch := [t for _, t in zip(range(BATCH), texts)]:
            hashes, per_doc = document_ngrams(batch, n)
            counts[f"examples:{name}"] += len(batch)
            counts[f"short_examples:{name}"] += int((per_doc == 0).sum())
            unique = np.unique(hashes)
            parts.append(unique)
            set_ids.append(np.full(len(unique), number, dtype=np.uint16))
    hashes = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    sets = np.concatenate(set_ids) if set_ids else np.empty(0, np.uint16)
    order = np.lexsort((sets, hashes))
    pairs = np.stack([hashes[order], sets[order].astype(np.uint64)])
    keep = np.ones(pairs.shape[1], dtype=bool)
    keep[1:] = (pairs[:, 1:] != pairs[:, :-1]).any(axis=0)  # one entry per (n-gram, set)
    return EvalIndex(hashes[order][keep], sets[order][keep], names, n), counts


def index_key(eval_sets: Sequence[Mapping[str, Any]], n: int) -> str:
    """A name for the index of these settings and files (their paths, sizes and modification times)."""
    described = []
    for spec in eval_sets:
        files = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in expand_paths(spec["paths"])]
        described.append({**spec, "files": files})
    return hashlib.sha256(json.dumps([n, described], sort_keys=True, default=str).encode()).hexdigest()[:24]


def load_or_build_index(
    eval_sets: Sequence[Mapping[str, Any]], n: int = DEFAULT_NGRAM, index_dir: str | Path | None = None
) -> EvalIndex:
    """The saved index of these settings, built (and saved) first if there is none."""
    check_eval_sets(list(eval_sets))
    path = Path(index_dir or default_index_dir()) / f"eval-{index_key(eval_sets, n)}.npz"
    if path.exists():
        return EvalIndex.load(path)
    index, _ = build_index(eval_sets, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    index.save(path)
    return index


def cut_spans(spans: Iterable[tuple[int, int]], length: int, window: int) -> list[tuple[int, int]]:
    """The [start, end) pieces of a text of `length` characters left after removing each span and
    `window` characters on either side of it."""
    pieces, start = [], 0
    for a, b in sorted(spans):
        a, b = max(0, a - window), min(length, b + window)
        if a > start:
            pieces.append((start, a))
        start = max(start, b)
    if start < length:
        pieces.append((start, length))
    return pieces


def decontaminate(
    eval_sets: list,
    ngram: int = DEFAULT_NGRAM,
    mode: str = "drop",
    window: int = 200,
    min_piece: int = 200,
    max_pieces: int = 10,
    index_dir: str | None = None,
) -> Stage:
    """The pipeline stage (see the module's docstring); builds or loads the index now."""
    if mode not in MODES:
        raise UserError(f"decontaminate: mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not isinstance(ngram, int) or ngram < 1:
        raise UserError(f"decontaminate: ngram must be a positive whole number of words; got {ngram!r}")
    index = load_or_build_index(eval_sets, ngram, index_dir)

    def stage(doc: Document, counts: Counter) -> str | None:
        words, per_doc, spans = word_spans([doc.text])
        if per_doc[0] < ngram:
            return None
        shingles, _ = combine_shingles(words, per_doc, ngram)
        hit, sets = index.matches(shingles)
        if not hit.any():
            return None
        for number, times in Counter(np.concatenate(sets).tolist()).items():
            counts[f"ngrams:{index.names[number]}"] += times
        for number in set(np.concatenate(sets).tolist()):
            counts[f"contaminated:{index.names[number]}"] += 1
        if mode == "drop" or len(doc.text.lower()) != len(doc.text):  # spans index the lower-cased text
            return "contaminated"
        starts = np.flatnonzero(hit)
        matched = zip(spans[0][starts].tolist(), spans[1][starts + ngram - 1].tolist())
        pieces = [(a, b) for a, b in cut_spans(matched, len(doc.text), window) if b - a >= min_piece]
        if not pieces or len(pieces) > max_pieces:
            return "contaminated"
        counts["cut_documents"] += 1
        doc.text = "\n\n".join(doc.text[a:b].strip() for a, b in pieces)
        return None

    return stage
