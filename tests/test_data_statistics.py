"""Each statistic that was rewritten for speed equals, number for number, a straightforward
reference implementation (the code it replaced), on random texts built to repeat at every rate,
on real prose in English, Chinese and Japanese, and at the edges (no words, one word, n larger
than the text)."""

import gzip
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from llmstack.data.languages import words as segment
from llmstack.data.ngrams import RepeatedNgrams
from llmstack.data.normalize import normalize_text
from llmstack.data.quality import _letterless
from llmstack.data.text_view import TextView, view

FIXTURE = Path(__file__).parent / "data" / "debian_reference.jsonl.gz"


def reference_top_ngram_chars(words, n):
    grams = Counter(zip(*(words[k:] for k in range(n))))
    count = max(grams.values(), default=0)
    if count < 2:
        return 0
    gram = next(g for g, c in grams.items() if c == count)  # insertion order: the first to occur
    return sum(map(len, gram)) * count


def reference_duplicate_ngram_chars(words, n):
    seen, covered = set(), [False] * len(words)
    for i, gram in enumerate(zip(*(words[k:] for k in range(n)))):
        if gram in seen:
            covered[i : i + n] = [True] * n
        else:
            seen.add(gram)
    return sum(len(w) for w, c in zip(words, covered) if c)


def reference_normalize(text):
    """The normalize stage's whitespace and control-character passes, each run unconditionally."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff]", "", text)
    text = re.sub(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]", " ", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def random_word_lists(seed=0):
    rng = random.Random(seed)
    lists = [[], ["a"], ["a", "a"], ["a", "b", "a", "b"], ["x"] * 30]
    for vocabulary in (1, 2, 3, 5, 10, 50, 500):
        words = ["".join(rng.choices("abcde", k=rng.randint(1, 6))) for _ in range(vocabulary)]
        for length in (3, 7, 20, 60, 300):
            lists.append(rng.choices(words, k=length))
    return lists


def prose_word_lists():
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    segmenter = {"en": "whitespace", "de": "whitespace", "fr": "whitespace", "es": "whitespace"}
    segmenter |= {"zh": "jieba", "ja": "characters"}
    texts = {}
    for row in rows:
        texts.setdefault(row["language"], []).append(row["text"])
    return [segment("\n\n".join(found[i : i + 4]), segmenter[lang]) for lang, found in texts.items() for i in (0, 40)]


@pytest.mark.parametrize("source", ["random", "prose"])
def test_repeated_ngram_statistics_equal_the_reference(source):
    for words in random_word_lists() if source == "random" else prose_word_lists():
        ngrams = RepeatedNgrams(words)
        for n in range(1, 22):
            assert ngrams.top_chars(n) == reference_top_ngram_chars(words, n), (words[:20], n)
            assert ngrams.duplicate_chars(n) == reference_duplicate_ngram_chars(words, n), (words[:20], n)


def test_word_and_line_counts_equal_the_reference():
    texts = ["", "  \n\t\n", "a b\n\n c ,, ...\n- 12 x_y __\n\u3000end", "— «» 3.14 ¹²³ ½ naïve _ -- "]
    for text in texts:
        words, text_view = text.split(), TextView(text, "whitespace")
        assert text_view.words == words
        assert text_view.word_chars == sum(map(len, words))
        assert text_view.lines == [line for line in text.split("\n") if line.strip()]
        letterless, not_real = _letterless(words)
        assert letterless == sum(not re.search(r"[^\W\d_]", w) for w in words)
        assert not_real == [w for w in words if not re.search(r"[^\W_]", w)]


def test_a_view_is_shared_while_the_text_object_is_the_same():
    text = "one two three"
    assert view(text, "whitespace") is view(text, "whitespace")
    assert view(text, "whitespace") is not view(text, "characters")
    copy = "".join(["one two ", "three"])  # equal, but another object: a rewritten text
    assert view(copy, "whitespace") is not view(text, "whitespace")


def test_normalize_passes_equal_the_reference():
    samples = [
        "plain ascii",
        "a \nb\t\nc\r\nd\re\n\n\n\nf",
        "x\x00y\x07z\x7f",
        "nb\u00a0sp\u3000id\u200bzw",
        " \ufeffbom ",
        "\x85next line\x9f",
        "tabs\t \t\nand spaces  \n",
    ]
    for text in samples:
        assert normalize_text(text, fix_mojibake=False, fold_widths=False) == reference_normalize(text), text
