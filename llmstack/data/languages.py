"""What the text statistics need to know about a language: how to cut it into words, which words
are stop words, and which quality thresholds differ from the English ones (as FineWeb-2 and
datatrove keep per-language settings).

Segmenters:
- "whitespace": words are whitespace-separated tokens (punctuation stays attached), as in Gopher;
- "jieba": Chinese words from jieba's dictionary (lazily imported; `pip install jieba`);
- "characters": for scripts written without spaces and without a segmenter here (Japanese, Thai,
  Lao, Khmer, Burmese): every character of such a script is one token, runs of other letters and
  digits are words. Statistics over these tokens are character n-gram statistics.
Tokens made only of punctuation are dropped by the segmenters that split punctuation off, so that
a "word" means the same thing as a whitespace token with its punctuation attached.

A document's language is `doc.meta["language"]` (set by the language stage) or, without it, a
guess from its script (kana: Japanese; Han: Chinese; Thai script: Thai; otherwise English).
"""

import inspect
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType
from typing import Any

from llmstack.errors import UserError, require

from .document import Document

# Scripts written without spaces between words: Thai, Lao, Burmese, Khmer, kana, Han, half-width katakana.
UNSEGMENTED = (
    "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
)
_CHARACTER_TOKEN = re.compile(rf"[{UNSEGMENTED}]|[^\s{UNSEGMENTED}]+")
_KANA = re.compile(r"[\u3040-\u30ff\uff66-\uff9f]")
_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_THAI = re.compile(r"[\u0e00-\u0e7f]")
_LATIN_LETTER = re.compile(r"[A-Za-z\u00c0-\u024f]")


@dataclass(frozen=True)
class LanguageProfile:
    segmenter: str = "whitespace"
    stop_words: frozenset = frozenset()
    # stage name -> {parameter: value}: where this language's default differs from the stage's own
    thresholds: dict = field(default_factory=dict)


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Unsegmented languages: counts are of characters or dictionary words, which are shorter than
# English words, and a CJK line holds more content per character, so the English rules are scaled
# to that; checked on the Debian Reference paragraphs in tests/data (tests/test_data_languages.py
# states the keep rates).
_SCALED_NGRAMS = {  # n-grams of about as many characters as Gopher's English word n-grams
    "top_ngram_char_fractions": {4: 0.2, 6: 0.18, 8: 0.16},
    "duplicate_ngram_char_fractions": {10: 0.15, 12: 0.14, 14: 0.13, 16: 0.12, 18: 0.11, 20: 0.10},
}
_CJK_THRESHOLDS = {
    "gopher_quality": {"min_mean_word_length": 1, "max_mean_word_length": 4},
    "gopher_repetition": _SCALED_NGRAMS,
    "fineweb": {"short_line_length": 12},
}
_CHARACTER_THRESHOLDS = {
    **_CJK_THRESHOLDS,
    "gopher_quality": {"min_words": 100, "min_mean_word_length": None, "max_mean_word_length": None},
}

PROFILES = {
    "en": LanguageProfile(stop_words=_words("the be to of and that have with")),
    "de": LanguageProfile(stop_words=_words("der die das und ist nicht ein eine zu mit sie es den von")),
    "fr": LanguageProfile(stop_words=_words("le la les de des et est un une que qui en pour dans pas")),
    "es": LanguageProfile(stop_words=_words("el la los las de y que en un una es por con para no se")),
    "it": LanguageProfile(stop_words=_words("il la di e che è un una per non in con del della si")),
    "pt": LanguageProfile(stop_words=_words("o a os as de e que do da em um uma para com não se")),
    "nl": LanguageProfile(stop_words=_words("de het een en van in is dat op te niet met voor zijn")),
    "zh": LanguageProfile(
        "jieba", _words("的 了 是 在 和 也 有 就 不 我 这 都 一个 上 你 他 为 与 或 及 可以"), _CJK_THRESHOLDS
    ),
    "ja": LanguageProfile(
        "characters", _words("の に は を た が で て と し れ さ な も い す る か"), _CHARACTER_THRESHOLDS
    ),
    **{code: LanguageProfile("characters", thresholds=_CHARACTER_THRESHOLDS) for code in ("th", "lo", "km", "my")},
}
DEFAULT_PROFILE = LanguageProfile()  # whitespace words; no stop-word rule without a list

# ISO 639-1: the codes CLD2, lingua and langdetect report. A per-language override naming another
# code is refused unless the config's language stage lists it (a detector's own codes, e.g. fastText's).
ISO_639_1 = frozenset(
    """
    aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de
    dv dz ee el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id
    ie ig ii ik io is it iu ja jv ka kg ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu
    lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng nl nn no nr nv ny oc oj om or os pa pi pl ps pt qu
    rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su sv sw ta te tg th ti tk tl tn to tr
    ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu
    """.split()
)


def profile(language: str) -> LanguageProfile:
    return PROFILES.get(language, DEFAULT_PROFILE)


def language_params(stage: Callable[..., Any], params: dict, overrides: dict | None, language: str) -> dict:
    """The keyword arguments of quality function `stage` for one language, later ones winning: the
    language's segmenter and stop words, the config's `params`, the language's built-in
    thresholds, the config's `languages: {code: {...}}` overrides for it."""
    accepted = inspect.signature(stage).parameters
    language_profile = profile(language)
    base = {
        key: value
        for key, value in (("segmenter", language_profile.segmenter), ("stop_words", language_profile.stop_words))
        if key in accepted
    }
    return {
        **base,
        **params,
        **language_profile.thresholds.get(stage.__name__, {}),
        **(overrides or {}).get(language, {}),
    }


def document_language(doc: Document) -> str:
    """The language the language stage found, or a guess from the script of the first characters."""
    language = doc.meta.get("language")
    if language and language != "unknown":
        return language
    return script_language(doc.text[:1000])


def script_language(sample: str) -> str:
    han, kana, thai = len(_HAN.findall(sample)), len(_KANA.findall(sample)), len(_THAI.findall(sample))
    latin = len(_LATIN_LETTER.findall(sample))
    if kana and kana + han > latin:
        return "ja"
    if han > latin:
        return "zh"
    if thai > latin:
        return "th"
    return "en"


def _is_punctuation(token: str) -> bool:
    return all(unicodedata.category(c)[0] in "PSZ" for c in token)


def line_words(line: str, segmenter: str) -> Sequence[str]:
    """The words of one line."""
    return line.split() if segmenter == "whitespace" else _segmented_line(line, segmenter)


@lru_cache(maxsize=8192)
def _segmented_line(line: str, segmenter: str) -> tuple:
    """A segmenter's words of one line (cached: several stages look at the same lines)."""
    if segmenter == "jieba":
        tokens = load_jieba().lcut(line)
    elif segmenter == "characters":
        tokens = _CHARACTER_TOKEN.findall(line)
    else:
        raise UserError(f"unknown word segmenter {segmenter!r}: use whitespace, jieba or characters")
    return tuple(t for t in tokens if not t.isspace() and not _is_punctuation(t))


def words(text: str, segmenter: str) -> list:
    """The words of a text, line by line."""
    if segmenter == "whitespace":
        return text.split()
    return [w for line in text.split("\n") for w in _segmented_line(line, segmenter)]


@lru_cache(maxsize=1)
def load_jieba() -> ModuleType:
    """The jieba module, its dictionary loaded, quiet."""
    import logging

    jieba = require("jieba", "data")  # or set `segmenter: characters` for Chinese

    jieba.setLogLevel(logging.WARNING)
    jieba.initialize()
    return jieba
