"""Chinese, Japanese and English text through the statistics, filters, near-dedup and language ID,
on real prose: paragraphs of the Debian Reference (tests/data/debian_reference.jsonl.gz, GPL-2+,
rebuilt by tests/data/make_debian_reference.py)."""

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from llmstack.data.dedup import KEEP, NEAR_DUPLICATE, document_duplicates, write_shard_keys
from llmstack.data.document import Document
from llmstack.data.langid import CLD2Detector
from llmstack.data.languages import document_language, line_words, words
from llmstack.data.minhash import MinHasher
from llmstack.data.pipeline import STAGES, cleaned_files, run_pipeline
from llmstack.errors import UserError

FIXTURE = Path(__file__).parent / "data" / "debian_reference.jsonl.gz"
QUALITY_STAGES = ("gopher_quality", "gopher_repetition", "c4_lines", "fineweb")


def paragraphs(language):
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        return [r["text"] for r in map(json.loads, f) if r["language"] == language]


def documents(language, per_document=5):
    """Consecutive paragraphs of the book, `per_document` to a document (48 documents a language)."""
    found = paragraphs(language)
    return ["\n\n".join(found[i : i + per_document]) for i in range(0, len(found) - per_document + 1, per_document)]


def first_drop(text, language=None):
    doc = Document(text, meta={"language": language} if language else {})
    for name in QUALITY_STAGES:
        reason = STAGES[name]()(doc, Counter())
        if reason is not None:
            return reason
    return None


def test_segmenters_cut_chinese_into_words_and_japanese_into_characters():
    assert words("Debian 系统的软件包管理工具。", "jieba") == ["Debian", "系统", "的", "软件包", "管理工具"]
    assert words("ファイルの説明。", "characters") == list("ファイルの説明")
    assert words("ls(1) を使う", "characters") == ["ls(1)", "を", "使", "う"]
    assert list(line_words("Hello, world!", "whitespace")) == ["Hello,", "world!"]
    with pytest.raises(UserError, match="segmenter"):
        words("x", "nope")


@pytest.mark.parametrize(
    "text, language",
    [
        ("软件包管理工具的使用方法。", "zh"),
        ("ファイルの説明です。", "ja"),
        ("ภาษาไทยเขียนติดกัน", "th"),
        ("The house", "en"),
    ],
)
def test_language_is_guessed_from_the_script_without_the_language_stage(text, language):
    assert document_language(Document(text)) == language
    assert document_language(Document(text, meta={"language": "de"})) == "de"


# Documents of 5 consecutive paragraphs kept by the four quality filters, with their default
# settings and each language's thresholds (deterministic, measured here): en 48/48, zh 45/48
# (3 dropped: paragraphs the book repeats), ja 47/48.
@pytest.mark.parametrize("language, kept", [("en", 48), ("zh", 45), ("ja", 47)])
def test_ordinary_prose_passes_the_default_filters_in_each_language(language, kept):
    docs = documents(language)
    assert len(docs) == 48
    assert sum(first_drop(text, language) is None for text in docs) == kept
    assert sum(first_drop(text) is None for text in docs) == kept  # language from the script alone


def test_a_chinese_paragraph_is_not_judged_by_whitespace():
    """The issue's case: Chinese prose was dropped as too few words, too few sentences, too many newlines."""
    text = "\n".join(paragraphs("zh")[:6])
    doc = Document(text)
    for name in ("gopher_quality", "c4_lines", "fineweb"):
        assert STAGES[name]()(doc, Counter()) is None, name


@pytest.mark.parametrize("language", ["en", "zh", "ja"])
def test_boilerplate_and_repetition_are_dropped(language):
    text = paragraphs(language)
    menu = "\n".join(p[:8].strip() for p in text[:40])  # navigation-like short lines without punctuation
    repeated = "\n\n".join([text[0]] * 2 + text[1:3] + [text[0]] * 2)
    looped = text[3] + " " + (text[4][:40] + " ") * 12 + text[5]
    for junk in (menu, repeated, looped):
        assert first_drop(junk, language) is not None, junk[:80]


def edit_span(text, fraction, alphabet, rng):
    """Replace one contiguous run of `fraction` of the characters (a rewritten sentence)."""
    span = int(len(text) * fraction)
    start = rng.randrange(len(text) - span)
    return text[:start] + "".join(rng.choices(alphabet, k=span)) + text[start + span :]


# Planted near-duplicates (one span of 5-15% of the characters rewritten) among the 48 documents,
# MinHash 112 hashes in 28 bands of 4 rows (the multilingual config's setting), word 5-grams
# (character 5-grams in Chinese and Japanese). Measured over seeds 0-2: recall 1.0, 1.0, 1.0 in
# en and zh, 0.98-1.0 in ja; no original removed in any.
@pytest.mark.parametrize("language", ["en", "zh", "ja"])
def test_planted_near_duplicates_are_found(tmp_path, language):
    rng = random.Random(0)
    docs = documents(language, per_document=3)
    alphabet = "".join(docs)
    edited = [edit_span(text, rng.uniform(0.05, 0.15), alphabet, rng) for text in docs]
    write_shard_keys(tmp_path / "shard", docs + edited, hasher=MinHasher(num_perm=112, bands=28))
    tables = [(str(tmp_path / "shard.exact"), 0)]
    status = document_duplicates(2 * len(docs), tables, [(str(tmp_path / "shard.lsh"), 0)], bands=28)
    recall = np.mean(status[len(docs) :] == NEAR_DUPLICATE)
    false_removals = np.mean(status[: len(docs)] != KEEP)
    assert recall >= 0.95 and false_removals <= 0.01, (recall, false_removals)


# CLD2 on the fixture's paragraphs (960: en 240, de/fr/es 80 each, zh 240, ja 240), measured here:
# 0.991 right overall; en, de, ja 1.0, zh 0.996, fr 0.96, es 0.94 (Galician and "unknown" for a
# few paragraphs full of command names). Deterministic.
def test_default_language_detector_is_accurate_on_real_paragraphs():
    detector = CLD2Detector()
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    right = [detector.detect(r["text"])[0] == r["language"] for r in rows]
    assert len(rows) == 960 and np.mean(right) >= 0.98


@pytest.mark.parametrize(
    "config, kept",
    [
        ("data_pipeline.yaml", {"en": 48}),
        # zh 46 under FineWeb-2's Chinese thresholds (45 under the built-in ones: those also check
        # top 6- and 8-word n-grams, which dropped document 30, top 8-gram 0.187 of its characters)
        ("data_zh.yaml", {"zh": 46}),
        ("data_multilingual.yaml", {"en": 48, "zh": 46, "ja": 47}),
    ],
)
def test_shipped_configs_keep_real_prose_in_their_languages(tmp_path, config, kept):
    """The configs of the README, whole (language ID, filters, PII, dedup), on five-paragraph documents
    of en, zh and ja (deterministic; the zh and ja drops are the ones the filter test names)."""
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for language in ("en", "zh", "ja"):
            for i, text in enumerate(documents(language)):
                f.write(json.dumps({"id": f"{language}-{i}", "text": text}, ensure_ascii=False) + "\n")
    root = Path(__file__).resolve().parents[1]
    run_pipeline(
        root / "configs" / config,
        {"inputs": [{"paths": [str(path)]}], "output": str(tmp_path / "out"), "workers": 1},
        show=lambda _: None,
    )
    clean = [json.loads(line) for p in cleaned_files(tmp_path / "out") for line in Path(p).read_text().splitlines()]
    assert Counter(d["id"].split("-")[0] for d in clean) == kept
