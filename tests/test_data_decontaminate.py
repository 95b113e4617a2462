"""Decontamination: documents sharing 13-grams (words; characters for Chinese and Japanese) with
evaluation sets are dropped or cut; clean ones are kept; counts per evaluation set are reported."""

import gzip
import itertools
import json
import random
import unicodedata
from pathlib import Path

import pytest

from llmstack.cli.main import main
from llmstack.data.decontaminate import build_index, cut_spans, decontaminate
from llmstack.data.document import Document
from llmstack.data.languages import UNSEGMENTED
from llmstack.data.stdlib_corpus import docstrings, stdlib_source_files
from llmstack.errors import UserError

DEBIAN = Path(__file__).parent / "data" / "debian_reference.jsonl.gz"
EVAL_LANGUAGES = ("en", "zh", "ja")
N = 13
ALONE = frozenset(chr(c) for lo, hi in zip(UNSEGMENTED[0::3], UNSEGMENTED[2::3]) for c in range(ord(lo), ord(hi) + 1))


def reference_words(text):
    """The words n-grams are made of, by a plain loop: runs of characters that are not spaces,
    punctuation or controls, each character of an unsegmented script alone; lower-cased."""
    alone, words, word = ALONE, [], ""
    for ch in text.lower():
        category = unicodedata.category(ch)
        separator = ch != "_" and (category[0] in "ZP" or category in ("Cc", "Cf", "Cs") and ch != "\u200d")
        if separator or ch in alone:
            if word:
                words.append(word)
            word = ""
            if ch in alone:
                words.append(ch)
        else:
            word += ch
    return words + [word] if word else words


def ngrams(text, n=N):
    words = reference_words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Evaluation sets: the even Debian Reference paragraphs in English, Chinese and Japanese (120
    each). Clean text: the odd paragraphs in all six languages and the docstrings of 160 stdlib
    files (about 1800 documents)."""
    root = tmp_path_factory.mktemp("decontaminate")
    rows = [json.loads(line) for line in gzip.open(DEBIAN, "rt", encoding="utf-8")]
    by_language = {}
    for row in rows:
        by_language.setdefault(row["language"], []).append(row["text"])
    evals = {lang: by_language[lang][0::2] for lang in EVAL_LANGUAGES}
    for lang, texts in evals.items():
        with open(root / f"eval-{lang}.jsonl", "w") as out:
            out.writelines(json.dumps({"question": t}, ensure_ascii=False) + "\n" for t in texts)
    clean = [t for texts in by_language.values() for t in texts[1::2]]
    files = itertools.islice(stdlib_source_files(), 160)
    clean += list(dict.fromkeys(doc for path in files for doc in docstrings(path, 200)))
    eval_ngrams = set().union(*(ngrams(t) for texts in evals.values() for t in texts))
    truly_clean = [t for t in clean if not ngrams(t) & eval_ngrams]  # real overlaps left out
    examples = {lang: [t for t in texts if len(reference_words(t)) >= 32] for lang, texts in evals.items()}
    return root, examples, truly_clean


def plant(rng, examples, host):
    """`host` with an excerpt of 15-30 words (characters in Chinese/Japanese) of a random example
    of a random language of `examples` inserted at a random space, its case changed and its
    spacing doubled at random."""
    example = rng.choice(examples[rng.choice(EVAL_LANGUAGES)])
    spans = [(m, m + len(w)) for m, w in word_offsets(example)]
    length = rng.randint(15, 30)
    first = rng.randrange(len(spans) - length)
    excerpt = example[spans[first][0] : spans[first + length - 1][1]]
    excerpt = rng.choice([str.upper, str.lower, str.title, str])(excerpt)
    if rng.random() < 0.5:
        excerpt = excerpt.replace(" ", "  ")
    spaces = [i for i, ch in enumerate(host) if ch == " "] or [len(host)]
    at = rng.choice(spaces)
    return host[:at] + " " + excerpt + " " + host[at:]


def word_offsets(text):
    """(offset, word) of each reference word of `text`, in the original (same-length lower-casing assumed)."""
    out, position = [], 0
    lowered = text.lower()
    for word in reference_words(text):
        position = lowered.index(word, position)
        out.append((position, word))
        position += len(word)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_contamination_is_found_and_clean_text_kept(corpus, tmp_path, seed):
    """300 clean documents with an excerpt of an evaluation example planted (English, Chinese or
    Japanese) among 1744 clean ones: recall >= 0.99 and false drops <= 0.1%. Measured over seeds
    0-4: recall 1.0 each time and 0 false drops of the 1744 documents that share no 13-gram with
    the evaluation sets by the reference count (clean texts that do, real overlaps, are left out)."""
    root, examples, truly_clean = corpus
    rng = random.Random(seed)
    planted = [plant(rng, examples, rng.choice(truly_clean)) for _ in range(300)]
    assert len(truly_clean) > 1700
    docs = [("clean", t) for t in truly_clean] + [("planted", t) for t in planted]
    rng.shuffle(docs)
    with open(tmp_path / "train.jsonl", "w") as out:
        for i, (kind, text) in enumerate(docs):
            out.write(json.dumps({"id": f"{kind}-{i}", "text": text}, ensure_ascii=False) + "\n")
    evals_arg = [f"{lang}={root / f'eval-{lang}.jsonl'}" for lang in EVAL_LANGUAGES]
    args = ["data", "decontaminate", "--data", str(tmp_path / "train.jsonl"), "--eval", *evals_arg]
    args += ["--eval-text-field", "question", "--out", str(tmp_path / "out"), "--index-dir", str(tmp_path / "index")]
    assert main(args) == 0
    kept = {json.loads(line)["id"] for f in (tmp_path / "out" / "clean").glob("shard-*.jsonl") for line in open(f)}
    kept_planted = sum(k.startswith("planted") for k in kept)
    kept_clean = sum(k.startswith("clean") for k in kept)
    recall = 1 - kept_planted / len(planted)
    false_drops = 1 - kept_clean / len(truly_clean)
    assert recall >= 0.99 and false_drops <= 0.001, (recall, false_drops)
    report = json.loads((tmp_path / "out" / "report.json").read_text())["stages"]["decontaminate"]
    per_set = {lang: report["counts"].get(f"contaminated:{lang}", 0) for lang in EVAL_LANGUAGES}
    assert report["drops"] == {"contaminated": len(docs) - len(kept)}
    assert all(per_set[lang] > 40 for lang in EVAL_LANGUAGES), per_set  # each set was planted ~100 times
    assert sum(per_set.values()) >= len(planted) - kept_planted


def test_character_ngrams_match_chinese_and_japanese_without_spaces(tmp_path):
    (tmp_path / "eval.jsonl").write_text(
        json.dumps({"text": "机器学习是人工智能的一个分支领域。"}, ensure_ascii=False)
        + "\n"
        + json.dumps({"text": "日本語の文章には単語の間に空白がありません"}, ensure_ascii=False)
        + "\n"
    )
    stage = decontaminate([{"name": "cjk", "paths": str(tmp_path / "eval.jsonl")}], index_dir=str(tmp_path))
    counts = __import__("collections").Counter()
    assert stage(Document("今天我们讨论机器学习是人工智能的一个分支领域的问题"), counts) == "contaminated"
    assert stage(Document("これは日本語の文章には単語の間に空白がありませんという話"), counts) == "contaminated"
    assert stage(Document("今天我们讨论机器学习是人工的一个分支"), counts) is None  # 12 characters in a row only
    assert counts["contaminated:cjk"] == 2 and counts["ngrams:cjk"] >= 2
    index, built = build_index([{"name": "cjk", "paths": str(tmp_path / "eval.jsonl")}])
    assert built["examples:cjk"] == 2 and built["short_examples:cjk"] == 0 and len(index.hashes) == 4 + 9


def test_cut_mode_removes_the_overlap_and_its_window(tmp_path):
    example = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex bold jugglers"
    (tmp_path / "eval.txt").write_text(example + "\n")
    sets = [{"name": "toy", "paths": str(tmp_path / "eval.txt"), "text_unit": "line"}]
    stage = decontaminate(sets, mode="cut", window=20, min_piece=30, index_dir=str(tmp_path))
    before, after = "A" * 300 + " left side words. ", " right side words " + "B" * 300
    doc, counts = Document(before + example.upper() + after), __import__("collections").Counter()
    assert stage(doc, counts) is None
    assert doc.text == before[: len(before) - 20].strip() + "\n\n" + after[20:].strip()
    assert counts["cut_documents"] == 1 and counts["contaminated:toy"] == 1
    assert stage(Document("short " + example + " text"), counts) == "contaminated"  # no piece long enough
    assert cut_spans([(10, 20), (15, 30)], 100, 5) == [(0, 5), (35, 100)]


def test_bad_settings_are_user_errors_before_any_work(tmp_path):
    (tmp_path / "e.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="no data file matches"):
        decontaminate([{"name": "a", "paths": str(tmp_path / "missing-*.jsonl")}])
    with pytest.raises(UserError, match="source names must be unique"):
        decontaminate([{"name": "a", "paths": str(tmp_path / "e.jsonl")}] * 2)
    with pytest.raises(UserError, match="mode must be one of drop, cut"):
        decontaminate([{"name": "a", "paths": str(tmp_path / "e.jsonl")}], mode="mask")
    bad = ["data", "decontaminate", "--data", "x", "--eval", "noequals", "--out", str(tmp_path / "o")]
    assert main(bad) == 2
