"""Heuristic quality filters, with the published thresholds as defaults.

- `gopher_quality`, `gopher_repetition`: Rae et al. 2021 (Gopher / MassiveText), appendix A.
- `c4_lines`: Raffel et al. 2020 (C4): drops lines, and documents that keep too few sentences.
- `fineweb`: Penedo et al. 2024 (FineWeb's own line-level rules).

Each is a stage `(doc, counts) -> None | reason`; a rule is disabled by setting its threshold to None.
Words are what `segmenter` makes of the text (see `languages`: whitespace tokens by default, jieba
words, or characters of unsegmented scripts); "lines" are the non-empty lines of the text.
`language_aware` turns one of these functions into a pipeline stage that picks the segmenter,
stop words and thresholds by each document's language.
"""

import inspect
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from operator import methodcaller
from typing import Any

from llmstack.errors import UserError

from .document import Document, Stage
from .languages import ISO_639_1, PROFILES, document_language, language_params, line_words
from .text_view import view

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
BULLETS = ("•", "-", "*", "‣", "◦", "▪", "●", "·")
ELLIPSES = ("...", "…")
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "．", "」", "』")
EDGE_PUNCTUATION = "\"'“”‘’()[]{}<>,.;:!?¡¿…-–—*#"
POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_POLICY = re.compile("|".join(map(re.escape, POLICY_PHRASES)))
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)|[。！？．]+")  # CJK sentences end without a space
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# Over "\n" + words one a line + "\n": the (rare) words without a letter or digit, and those
# without a letter, each with the "\n" before it (a literal first character: the regex engine skips
# to each "\n" at C speed, where "^" would be tried at every character).
_NOT_ALNUM_WORD = re.compile(r"\n(?:[^\w\n]|_)+(?=\n)")
_NOT_ALPHA_WORD = re.compile(r"\n(?:[^\w\n]|[\d_])+(?=\n)")
# {n: maximum fraction} or ((n, maximum fraction), ...); n is a string where the config went through JSON.
NgramFractions = Mapping[int, float] | Mapping[str, float] | Iterable[tuple[int, float]]


def _duplicates(items: Sequence[str]) -> tuple[int, int]:
    """Number of items that repeat an earlier one, and the characters in those repeats."""
    if len(set(items)) == len(items):  # the common case, at C speed
        return 0, 0
    seen, count, chars = set(), 0, 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def gopher_quality(
    doc: Document,
    counts: Counter,
    min_words: int | None = 50,
    max_words: int | None = 100_000,
    min_mean_word_length: float | None = 3,
    max_mean_word_length: float | None = 10,
    max_symbol_word_ratio: float | None = 0.1,
    max_bullet_lines_ratio: float | None = 0.9,
    max_ellipsis_lines_ratio: float | None = 0.3,
    min_alpha_words_ratio: float | None = 0.8,
    min_stop_words: int | None = 2,
    stop_words: Collection[str] = STOP_WORDS,
    segmenter: str = "whitespace",
) -> str | None:
    """Gopher quality rules. Word counts and lengths ignore tokens made only of punctuation; the
    symbol ratio is ('#' count + ellipsis count) / words, each checked alone. Without stop words
    (a language with no list) the stop-word rule is off."""
    text = doc.text
    text_view = view(text, segmenter)
    words = text_view.words
    if min_words is not None and len(words) < min_words:  # fewer words, fewer real ones: no regex needed
        return "gopher_too_few_words"
    letterless, not_real = _letterless(words)
    real_words = len(words) - len(not_real)
    if min_words is not None and real_words < min_words:
        return "gopher_too_few_words"
    if max_words is not None and real_words > max_words:
        return "gopher_too_many_words"
    if not real_words:
        return "gopher_too_few_words"
    mean_length = (text_view.word_chars - sum(map(len, not_real))) / real_words
    if min_mean_word_length is not None and mean_length < min_mean_word_length:
        return "gopher_short_words"
    if max_mean_word_length is not None and mean_length > max_mean_word_length:
        return "gopher_long_words"
    if max_symbol_word_ratio is not None:
        ellipses = text.count("...") + text.count("…")
        if max(text.count("#"), ellipses) / len(words) > max_symbol_word_ratio:
            return "gopher_symbol_ratio"
    lines = text_view.lines
    if max_bullet_lines_ratio is not None:
        bullets = sum(map(methodcaller("startswith", BULLETS), map(str.lstrip, lines)))
        if bullets / len(lines) > max_bullet_lines_ratio:
            return "gopher_bullet_lines"
    if max_ellipsis_lines_ratio is not None:
        trailing = sum(map(methodcaller("endswith", ELLIPSES), map(str.rstrip, lines)))
        if trailing / len(lines) > max_ellipsis_lines_ratio:
            return "gopher_ellipsis_lines"
    if min_alpha_words_ratio is not None:
        if 1 - letterless / len(words) < min_alpha_words_ratio:
            return "gopher_alpha_words"
    if min_stop_words is not None and stop_words:
        if not _has_stop_words(words, set(stop_words), min_stop_words):
            return "gopher_stop_words"
    return None


def _letterless(words: Sequence[str]) -> tuple[int, list[str]]:
    """How many words have no letter, and those of them without a digit either (the words that
    are not "real"): a regex scan over the words one a line, then one over the few it found."""
    not_alpha = _NOT_ALPHA_WORD.findall("\n" + "\n".join(words) + "\n")
    not_real = _NOT_ALNUM_WORD.findall("".join(not_alpha) + "\n") if not_alpha else []
    return len(not_alpha), [word[1:] for word in not_real]


def _has_stop_words(words: Iterable[str], stops: set[str], minimum: int) -> bool:
    found = 0
    for w in words:
        if w.strip(EDGE_PUNCTUATION).lower() in stops:
            found += 1
            if found >= minimum:
                return True
    return found >= minimum


def gopher_repetition(
    doc: Document,
    counts: Counter,
    max_duplicate_line_fraction: float | None = 0.3,
    max_duplicate_paragraph_fraction: float | None = 0.3,
    max_duplicate_line_char_fraction: float | None = 0.2,
    max_duplicate_paragraph_char_fraction: float | None = 0.2,
    top_ngram_char_fractions: NgramFractions | None = ((2, 0.2), (3, 0.18), (4, 0.16)),
    duplicate_ngram_char_fractions: NgramFractions | None = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    ),
    segmenter: str = "whitespace",
) -> str | None:
    """Gopher repetition rules. Line and paragraph character fractions are over len(text); n-gram
    character fractions count word characters only (whitespace excluded on both sides)."""
    text = doc.text
    text_view = view(text, segmenter)
    for unit, parts, max_fraction, max_char_fraction in (
        (
            "paragraph",
            _PARAGRAPH_BREAK.split(text.strip()),
            max_duplicate_paragraph_fraction,
            max_duplicate_paragraph_char_fraction,
        ),
        ("line", text_view.lines, max_duplicate_line_fraction, max_duplicate_line_char_fraction),
    ):
        count, chars = _duplicates(parts)
        if max_fraction is not None and count / max(len(parts), 1) > max_fraction:
            return f"gopher_duplicate_{unit}s"
        if max_char_fraction is not None and chars / max(len(text), 1) > max_char_fraction:
            return f"gopher_duplicate_{unit}_chars"
    total = text_view.word_chars or 1
    for n, max_fraction in sorted((int(n), f) for n, f in dict(top_ngram_char_fractions or {}).items()):
        chars = text_view.ngrams.top_chars(n)
        if chars / total > max_fraction:
            return f"gopher_top_{n}gram"
        if not chars:  # no n-gram repeats, so no longer one does
            break
    duplicate = sorted((int(n), fraction) for n, fraction in dict(duplicate_ngram_char_fractions or {}).items())
    for i, (n, max_fraction) in enumerate(duplicate):
        fraction = text_view.ngrams.duplicate_chars(n) / total
        if fraction > max_fraction:
            return f"gopher_duplicate_{n}grams"
        # Longer repeated n-grams cover a subset of what shorter ones cover: below every remaining
        # threshold now, below them for good.
        if fraction <= min(f for _, f in duplicate[i:]):
            break
    return None


def _longest(line: str, segmenter: str) -> int:
    return max(map(len, line_words(line, segmenter)), default=0)


def _count_sentences(line: str) -> int:
    return len(_SENTENCE_END.findall(line)) or 1


def c4_lines(
    doc: Document,
    counts: Counter,
    min_words_per_line: int | None = 3,
    max_word_length: int | None = 1000,
    min_sentences: int | None = 5,
    remove_citations: bool = True,
    require_terminal_punctuation: bool = True,
    remove_javascript_lines: bool = True,
    remove_policy_lines: bool = True,
    drop_lorem_ipsum: bool = True,
    drop_curly_brackets: bool = True,
    segmenter: str = "whitespace",
) -> str | None:
    """C4 rules: drop lines that do not end in terminal punctuation (or end in an ellipsis), have
    fewer than `min_words_per_line` words, a word longer than `max_word_length`, mention javascript
    or a cookie/terms policy; drop the document if a line that passed those checks has "lorem ipsum"
    or a curly bracket (C4's order), or if fewer than `min_sentences` sentences are kept. Removed
    lines are counted in `counts`."""
    kept, sentences = [], 0
    for line in doc.text.split("\n"):
        line = line.strip()
        if not line:
            continue
        if remove_citations and "[" in line:
            line = _CITATION.sub("", line)
        # No word is longer than its line, and the words are needed only past the punctuation test.
        if max_word_length is not None and len(line) > max_word_length and _longest(line, segmenter) > max_word_length:
            reason = "lines_removed_long_word"
        elif require_terminal_punctuation and (not line.endswith(TERMINAL_PUNCTUATION) or line.endswith(ELLIPSES)):
            reason = "lines_removed_no_terminal_punctuation"
        elif min_words_per_line is not None and len(line_words(line, segmenter)) < min_words_per_line:
            reason = "lines_removed_few_words"
        else:
            lower = line.lower()
            if drop_lorem_ipsum and "lorem ipsum" in lower:
                return "c4_lorem_ipsum"
            if remove_javascript_lines and "javascript" in lower:
                reason = "lines_removed_javascript"
            elif drop_curly_brackets and "{" in line:
                return "c4_curly_bracket"
            elif remove_policy_lines and _POLICY.search(lower):
                reason = "lines_removed_policy"
            else:
                kept.append(line)
                sentences += _count_sentences(line)
                continue
        counts[reason] += 1
    if min_sentences is not None and sentences < min_sentences:
        return "c4_too_few_sentences"
    doc.text = "\n".join(kept)
    return None


def fineweb(
    doc: Document,
    counts: Counter,
    terminal_punctuation_threshold: float | None = 0.12,
    short_line_threshold: float | None = 0.67,
    short_line_length: int = 30,
    duplicate_line_chars_threshold: float | None = 0.01,
    newline_word_threshold: float | None = 0.3,
    segmenter: str = "whitespace",
) -> str | None:
    """FineWeb rules. Drop when: the fraction of lines ending in terminal punctuation is <= 0.12;
    the fraction of lines of <= `short_line_length` characters is >= 0.67; characters in duplicated
    lines / non-newline characters is >= 0.01; newlines / words is > 0.3."""
    text = doc.text
    text_view = view(text, segmenter)
    lines = text_view.lines
    if not lines:
        return "fineweb_empty"
    if terminal_punctuation_threshold is not None:
        ending = sum(map(methodcaller("endswith", TERMINAL_PUNCTUATION), map(str.rstrip, lines)))
        if ending / len(lines) <= terminal_punctuation_threshold:
            return "fineweb_terminal_punctuation"
    if short_line_threshold is not None:
        short = sum(map(short_line_length.__ge__, map(len, lines)))
        if short / len(lines) >= short_line_threshold:
            return "fineweb_short_lines"
    if duplicate_line_chars_threshold is not None:
        _, chars = _duplicates(lines)
        if chars / len(text.replace("\n", "")) >= duplicate_line_chars_threshold:
            return "fineweb_duplicate_lines"
    if newline_word_threshold is not None:
        if text.count("\n") / max(len(text_view.words), 1) > newline_word_threshold:
            return "fineweb_newline_ratio"
    return None


def language_aware(stage: Callable[..., str | None]) -> Callable[..., Stage]:
    """The pipeline factory of a quality stage: `languages: {code: {param: value}}` in its config
    overrides thresholds per language; each document is judged with its language's segmenter,
    stop words and thresholds (see `languages.language_params`). `factory.check_languages` refuses
    overrides naming an unknown language or parameter (the pipeline calls it before any work)."""
    accepted = sorted(set(inspect.signature(stage).parameters) - {"doc", "counts"})

    def check_languages(languages: Any, listed: Collection[str] | None = None) -> None:
        """One UserError naming every bad override: a code that is neither ISO 639-1 nor a language of
        `languages.PROFILES` (nor in `listed`), a code outside `listed` (the languages the config's
        language stage keeps: no document of another reaches this stage), an unknown parameter."""
        if languages is None:
            return
        if not isinstance(languages, dict):
            raise UserError(
                f"stage {stage.__name__}: `languages` maps a language code to {{parameter: value}}; got {languages!r}"
            )
        problems = []
        for code, values in languages.items():
            if listed and code not in listed:
                problems.append(f"{code}: the language stage keeps only {sorted(listed)}, so no document would use it")
            elif not listed and code not in ISO_639_1 and code not in PROFILES:
                problems.append(f"{code}: unknown language code (use ISO 639-1 codes: zh, ja, de, ...)")
            if not isinstance(values, dict):
                problems.append(f"{code}: must be a mapping of parameters; got {values!r}")
            elif unknown := sorted(set(values) - set(accepted)):
                problems.append(f"{code}: unknown parameters {unknown}")
        if problems:
            raise UserError(
                f"stage {stage.__name__}: bad per-language overrides (`languages:`): "
                + "; ".join(problems)
                + f". Parameters of {stage.__name__}: {', '.join(accepted)}"
            )

    def factory(languages: dict[str, dict[str, Any]] | None = None, **params: Any) -> Stage:
        inspect.signature(stage).bind(None, None, **params)  # a misspelt parameter fails now, not mid-job
        check_languages(languages)
        per_language: dict[str, dict[str, Any]] = {}

        def judge(doc: Document, counts: Counter) -> str | None:
            language = document_language(doc)
            if language not in per_language:
                per_language[language] = language_params(stage, params, languages, language)
            return stage(doc, counts, **per_language[language])

        return judge

    factory.check_languages = check_languages  # type: ignore[attr-defined]
    return factory
