"""Every quality rule at its published default threshold: a document just inside is kept, one just
outside is dropped with the rule's reason. Other rules of the same filter are switched off (None)
so each document tests one rule."""

import random
import string
from collections import Counter

import pytest

from llmstack.data.document import Document
from llmstack.data.quality import c4_lines, fineweb, gopher_quality, gopher_repetition

GOPHER_QUALITY_RULES = (
    "min_words",
    "max_words",
    "min_mean_word_length",
    "max_mean_word_length",
    "max_symbol_word_ratio",
    "max_bullet_lines_ratio",
    "max_ellipsis_lines_ratio",
    "min_alpha_words_ratio",
    "min_stop_words",
)
FINEWEB_RULES = (
    "terminal_punctuation_threshold",
    "short_line_threshold",
    "duplicate_line_chars_threshold",
    "newline_word_threshold",
)


def run(stage, text, **params):
    doc = Document(text)
    return stage(doc, Counter(), **params), doc


def only(rules, keep):
    """Switch off every rule but `keep`, which keeps its default."""
    return {rule: None for rule in rules if rule != keep}


def unique_words(n, length, seed=0):
    rng = random.Random(seed)
    words = set()
    while len(words) < n:
        words.add("".join(rng.choices(string.ascii_lowercase, k=length)))
    return sorted(words)


def filler(chars, seed=1):
    """Unique words with exactly `chars` letters in total."""
    sizes = [7] * (chars // 7) + ([chars % 7] if chars % 7 else [])
    return [w[:s] for w, s in zip(unique_words(len(sizes), 7, seed), sizes)]


# --- Gopher quality -----------------------------------------------------------------------------


def words(n, vocab=("the", "house", "with", "garden")):
    return [vocab[i % len(vocab)] for i in range(n)]


GOPHER_QUALITY_CASES = {
    # rule: (text just inside, text just outside, reason)
    "min_words": (" ".join(words(50)), " ".join(words(49)), "gopher_too_few_words"),
    "max_words": (" ".join(words(100_000)), " ".join(words(100_001)), "gopher_too_many_words"),
    "min_mean_word_length": (" ".join(["cat"] * 50), " ".join(["cat"] * 49 + ["to"]), "gopher_short_words"),
    "max_mean_word_length": (
        " ".join(["abcdefghij"] * 50),
        " ".join(["abcdefghij"] * 49 + ["abcdefghijk"]),
        "gopher_long_words",
    ),
    "max_symbol_word_ratio": (
        " ".join(["#house"] * 5 + ["house"] * 45),
        " ".join(["#house"] * 6 + ["house"] * 44),
        "gopher_symbol_ratio",
    ),
    "max_bullet_lines_ratio": (
        "\n".join(["- the house"] * 9 + ["the house"]),
        "\n".join(["- the house"] * 10),
        "gopher_bullet_lines",
    ),
    "max_ellipsis_lines_ratio": (
        "\n".join(["the house..."] * 3 + ["the house"] * 7),
        "\n".join(["the house…"] * 4 + ["the house"] * 6),
        "gopher_ellipsis_lines",
    ),
    "min_alpha_words_ratio": (
        " ".join(["house"] * 40 + ["123"] * 10),
        " ".join(["house"] * 39 + ["123"] * 11),
        "gopher_alpha_words",
    ),
    "min_stop_words": ("house The garden, the. river", "house the garden river", "gopher_stop_words"),
}


@pytest.mark.parametrize("rule", GOPHER_QUALITY_RULES)
def test_gopher_quality_rule_at_its_threshold(rule):
    inside, outside, reason = GOPHER_QUALITY_CASES[rule]
    params = only(GOPHER_QUALITY_RULES, rule)
    assert run(gopher_quality, inside, **params)[0] is None
    assert run(gopher_quality, outside, **params)[0] == reason


def test_gopher_quality_defaults_keep_ordinary_prose():
    text = "The house with the garden is near the river, and the children play there every day. " * 8
    assert run(gopher_quality, text)[0] is None


# --- Gopher repetition --------------------------------------------------------------------------

NO_REPETITION_RULES = dict(
    max_duplicate_line_fraction=None,
    max_duplicate_paragraph_fraction=None,
    max_duplicate_line_char_fraction=None,
    max_duplicate_paragraph_char_fraction=None,
    top_ngram_char_fractions=None,
    duplicate_ngram_char_fractions=None,
)


def repetition(text, rule, value=None):
    params = dict(NO_REPETITION_RULES)
    if value is None:
        del params[rule]  # the default applies
    else:
        params[rule] = value
    return run(gopher_repetition, text, **params)[0]


@pytest.mark.parametrize("unit,separator", [("line", "\n"), ("paragraph", "\n\n")])
def test_duplicate_line_and_paragraph_fraction(unit, separator):
    parts = unique_words(10, 8)
    inside = parts[:7] + parts[:3]  # 3 of 10 repeat: 0.3 is not above 0.3
    outside = parts[:6] + parts[:4]
    rule = f"max_duplicate_{unit}_fraction"
    assert repetition(separator.join(inside), rule) is None
    assert repetition(separator.join(outside), rule) == f"gopher_duplicate_{unit}s"


@pytest.mark.parametrize("unit,separator", [("line", "\n"), ("paragraph", "\n\n")])
def test_duplicate_line_and_paragraph_chars(unit, separator):
    repeated = "abcdefghij"  # 10 characters, twice: 10 duplicated characters
    for unique_length, expected in (
        (50 - 20 - 2 * len(separator), None),  # 10 / 50 = 0.2
        (49 - 20 - 2 * len(separator), f"gopher_duplicate_{unit}_chars"),
    ):
        text = separator.join(["x" * unique_length, repeated, repeated])
        assert repetition(text, f"max_duplicate_{unit}_char_fraction") == expected


@pytest.mark.parametrize("n,fraction", [(2, 0.2), (3, 0.18), (4, 0.16)])
def test_top_ngram_char_fraction(n, fraction):
    total = 1000
    gram_chars = round(fraction * total / 2)  # the n-gram occurs twice
    gram = [w[: gram_chars // n + (i < gram_chars % n)] for i, w in enumerate(unique_words(n, 200, seed=2))]
    for fill, expected in ((total - 2 * gram_chars, None), (total - 2 * gram_chars - 1, f"gopher_top_{n}gram")):
        rest = filler(fill)
        text = " ".join(gram + rest[:1] + gram + rest[1:])
        assert repetition(text, "top_ngram_char_fractions", {n: fraction}) == expected


@pytest.mark.parametrize("n,fraction", [(5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)])
def test_duplicated_ngram_char_fraction(n, fraction):
    total = 1000
    gram_chars = round(fraction * total)  # the second occurrence is the duplicated part
    gram = [w[: gram_chars // n + (i < gram_chars % n)] for i, w in enumerate(unique_words(n, 200, seed=3))]
    for fill, expected in ((total - 2 * gram_chars, None), (total - 2 * gram_chars - 1, f"gopher_duplicate_{n}grams")):
        rest = filler(fill)
        text = " ".join(gram + rest[:1] + gram + rest[1:])
        assert repetition(text, "duplicate_ngram_char_fractions", {n: fraction}) == expected


def test_gopher_repetition_defaults_keep_ordinary_prose():
    text = "\n\n".join(" ".join(unique_words(60, 6, seed=s)) + "." for s in range(5))
    assert run(gopher_repetition, text)[0] is None


# --- C4 -----------------------------------------------------------------------------------------

SENTENCE = "The river runs past the old mill."


def test_c4_keeps_five_sentences_and_drops_four():
    assert run(c4_lines, "\n".join([SENTENCE] * 5))[0] is None
    assert run(c4_lines, "\n".join([SENTENCE] * 4))[0] == "c4_too_few_sentences"
    assert run(c4_lines, "One is here. Two is here! Three is here? Four is here. Five is here.")[0] is None


def test_c4_removes_bad_lines_and_counts_them():
    good = [SENTENCE] * 5
    bad = [
        "Menu Home About",
        "Two words.",
        "Please enable JavaScript to view this page.",
        "This site uses cookies to improve it.",
        "A " + "x" * 1001 + " word.",
        "It goes on and on...",
    ]
    counts = Counter()
    doc = Document("\n".join(good[:2] + bad + good[2:]))
    assert c4_lines(doc, counts) is None
    assert doc.text == "\n".join(good)
    assert counts == Counter(
        lines_removed_no_terminal_punctuation=2,
        lines_removed_few_words=1,
        lines_removed_javascript=1,
        lines_removed_policy=1,
        lines_removed_long_word=1,
    )


def test_c4_removes_citations_and_drops_lorem_ipsum_and_code():
    reason, doc = run(c4_lines, "\n".join([SENTENCE[:-1] + "[1][citation needed]."] * 5))
    assert reason is None and doc.text == "\n".join([SENTENCE] * 5)
    assert run(c4_lines, "\n".join([SENTENCE] * 5 + ["Lorem ipsum dolor sit amet."]))[0] == "c4_lorem_ipsum"
    assert run(c4_lines, "\n".join([SENTENCE] * 5 + ["Call f() { return 1; } now."]))[0] == "c4_curly_bracket"


# --- FineWeb ------------------------------------------------------------------------------------


def fw(text, rule):
    return run(fineweb, text, **only(FINEWEB_RULES, rule))[0]


def lines(n, end="", length=40, seed=4):
    return [w + end for w in unique_words(n, length, seed)]


def test_fineweb_terminal_punctuation():
    rule = "terminal_punctuation_threshold"
    assert fw("\n".join(lines(13, ".") + lines(87, "", seed=5)), rule) is None  # 0.13 > 0.12
    assert fw("\n".join(lines(12, ".") + lines(88, "", seed=5)), rule) == "fineweb_terminal_punctuation"


def test_fineweb_short_lines():
    rule = "short_line_threshold"
    assert fw("\n".join(lines(66, length=30) + lines(34, length=31, seed=5)), rule) is None  # 0.66
    assert fw("\n".join(lines(67, length=30) + lines(33, length=31, seed=5)), rule) == "fineweb_short_lines"


def test_fineweb_duplicate_line_chars():
    rule = "duplicate_line_chars_threshold"
    repeated = ["abcdefghij"] * 2  # 10 duplicated characters
    assert fw("\n".join(repeated + ["x" * 981]), rule) is None  # 10 / 1001 < 0.01
    assert fw("\n".join(repeated + ["x" * 980]), rule) == "fineweb_duplicate_lines"


def test_fineweb_newline_ratio():
    rule = "newline_word_threshold"
    assert fw("a b c\nd e f\ng h\ni j", rule) is None  # 3 newlines / 10 words
    assert fw("a b c\nd e\nf g\nh\ni j", rule) == "fineweb_newline_ratio"


# Per-language thresholds: a stage's `languages: {code: {parameter: value}}`, chosen by each
# document's meta.language (the language stage's result).
GERMAN = (
    "Die Donaudampfschifffahrtsgesellschaft veröffentlichte gestern ihre Jahresabschlussberichte. "
    "Die Bundesverkehrswegeplanung berücksichtigt Hochwasserschutzmaßnahmen und Uferbefestigungen. "
    "Die Geschäftsführung erwartet Fahrgaststeigerungen, weil Kreuzfahrtunternehmen Anlegestellen "
    "benötigen und Schifffahrtsverbände Modernisierungsinvestitionen fordern. "
) * 3  # 72 words of mean length 13.7
ENGLISH = (
    "The river company published its annual report yesterday, and the plan of the new year is to "
    "build a dock. The city and the port have agreed to share the cost of the work on the banks. "
) * 2  # 74 words


def test_each_document_is_judged_by_its_own_languages_thresholds():
    from llmstack.data.pipeline import STAGES

    overrides = {"de": {"max_mean_word_length": 15}, "en": {"min_words": 80}}
    stage = STAGES["gopher_quality"](min_stop_words=None, languages=overrides)
    judge = lambda text, language: stage(Document(text, meta={"language": language}), Counter())  # noqa: E731
    # German compounds: a mean word length over 10 (the default), under German's 15
    assert gopher_quality(Document(GERMAN), Counter(), min_stop_words=None) == "gopher_long_words"
    assert judge(GERMAN, "de") is None
    assert judge(GERMAN, "fr") == "gopher_long_words"  # no override: the default 10
    # the same English text: 74 words pass the default 50, not English's 80
    assert judge(ENGLISH, "fr") is None
    assert judge(ENGLISH, "en") == "gopher_too_few_words"


def test_llmstack_data_clean_applies_the_detected_languages_thresholds(tmp_path):
    import json
    from pathlib import Path

    pytest.importorskip("pycld2")
    from llmstack.data.pipeline import cleaned_files, run_pipeline

    path = tmp_path / "raw.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in (("de", GERMAN), ("en", ENGLISH))))
    config = {
        "inputs": [{"paths": [str(path)]}],
        "output": str(tmp_path / "out"),
        "stages": [
            {"language": {"languages": ["en", "de"]}},
            {"gopher_quality": {"min_stop_words": None, "languages": {"de": {"max_mean_word_length": 15}}}},
        ],
    }
    for overrides, kept in (
        ({}, ["de", "en"]),
        ({"en": {"min_words": 80}}, ["de"]),
        ({"de": {"min_words": 80}}, ["en"]),
    ):
        config["stages"][1]["gopher_quality"]["languages"] |= overrides
        stats = run_pipeline({**config, "output": str(tmp_path / f"out-{len(kept)}-{kept[0]}")}, show=lambda _: None)
        found = [
            json.loads(line)
            for p in cleaned_files(tmp_path / f"out-{len(kept)}-{kept[0]}")
            for line in Path(p).read_text().splitlines()
        ]
        assert sorted(d["id"] for d in found) == kept
        assert {d["id"]: d["meta"]["language"] for d in found} == {i: i for i in kept}
        assert stats["gopher_quality"].drops == ({"gopher_too_few_words": 1} if len(kept) == 1 else {})
        config["stages"][1]["gopher_quality"]["languages"] = {"de": {"max_mean_word_length": 15}}


@pytest.mark.parametrize(
    "stages, message",
    [
        ([{"fineweb": {"languages": {"jp": {"newline_word_threshold": 0.2}}}}], "jp: unknown language code"),
        ([{"fineweb": {"languages": {"de": {"newline_ratio": 0.2}}}}], r"de: unknown parameters \['newline_ratio'\]"),
        ([{"fineweb": {"languages": {"de": 0.2}}}], "de: must be a mapping"),
        ([{"gopher_quality": {"languages": [{"de": {"min_words": 3}}]}}], "maps a language code to"),
        (
            [{"language": {"languages": ["en", "de"]}}, {"gopher_repetition": {"languages": {"zh": {}}}}],
            r"zh: the language stage keeps only \['de', 'en'\]",
        ),
        ([{"language": {"thresholds": {"zh": 0.5}}}], r"thresholds for \['zh'\], which its `languages` \['en'\] drop"),
    ],
)
def test_bad_per_language_settings_are_refused_before_any_work(tmp_path, stages, message):
    from llmstack.data.pipeline import run_pipeline
    from llmstack.errors import UserError

    config = {"inputs": [{"paths": [str(tmp_path / "none.jsonl")]}], "output": str(tmp_path / "out"), "stages": stages}
    with pytest.raises(UserError, match=message):
        run_pipeline(config, show=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_codes_outside_iso_639_1_are_accepted_when_the_language_stage_names_them():
    from llmstack.data.pipeline import load_config

    stages = [{"language": {"languages": ["cmn"]}}, {"fineweb": {"languages": {"cmn": {"short_line_length": 12}}}}]
    assert load_config({"inputs": [{"paths": ["x"]}], "output": "o", "stages": stages})["stages"][1][0] == "fineweb"
