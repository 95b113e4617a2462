"""Language identification behind a small interface, so the detector can be swapped per cluster.

A detector is any object with `detect(text) -> (iso_639_1_code, score)`. Built in:
- "cld2" (default): Compact Language Detector 2 through `pycld2`, model compiled into the wheel,
  deterministic, 80+ languages. Score: the share of the text's letters in the top language (its
  scripts summed: Simplified and Traditional Chinese are both `zh`). Measured
  on this project's machine (bench/bench_pipeline.py; tests/test_data_languages.py): accuracy
  >= 0.95 on Debian Reference paragraphs in en/de/fr/es/ja/zh, and tens of times faster than lingua.
- "lingua": lingua-language-detector, models inside the wheel, deterministic, the most accurate
  on short texts (0.995 on the same paragraphs) but ~0.1-0.3 MB/s a core. Measured on
  this project's 2-core machine over stdlib docstrings: ~0.2-0.3 MB/s a core, langdetect ~0.15 MB/s;
  both were 100% right on English and on short German/French/Spanish/Italian sentences. Low-accuracy
  mode (trigram models only) is the default: it loads in under a second, where high-accuracy mode
  spent ~20 s and ~1 GB loading every n-gram model in each worker, for no gain on documents of a
  few hundred characters (lingua says the difference is for texts under ~120 characters).
- "langdetect": Google's language-detection port (seeded, so repeatable).
- "fasttext": fastText lid.176, for users who have the model file (`model_path`); the `fasttext`
  package is needed then, and nothing is downloaded.
Any other detector: `detector: "package.module:ClassName"` in the config.
"""

import importlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

from llmstack.errors import UserError, require

from .document import Document, Stage

UNKNOWN = ("unknown", 0.0)


class CLD2Detector:
    def __init__(self, best_effort: bool = True) -> None:
        self._cld2, self.best_effort = require("pycld2", "data"), best_effort

    def detect(self, text: str) -> tuple[str, float]:
        try:
            _, _, details = self._cld2.detect(text, bestEffort=self.best_effort)
        except self._cld2.error:  # text Python holds but UTF-8 cannot (lone surrogates)
            return UNKNOWN
        if details[1][1] == "un":  # one language found: the common case
            _, code, percent, _ = details[0]
            return (code.split("-")[0], percent / 100) if code != "un" and percent else UNKNOWN
        shares: Counter[str] = Counter()  # CLD2 names scripts apart (zh, zh-Hant): one ISO 639-1 code each
        for _, code, percent, _ in details:
            if code != "un":
                shares[code.split("-")[0]] += percent
        if not shares:
            return UNKNOWN
        code, percent = shares.most_common(1)[0]
        return code, percent / 100


class LinguaDetector:
    def __init__(self, low_accuracy: bool = True) -> None:
        builder = require("lingua", "data").LanguageDetectorBuilder.from_all_languages()
        self._detector = (builder.with_low_accuracy_mode() if low_accuracy else builder).build()

    def detect(self, text: str) -> tuple[str, float]:
        values = self._detector.compute_language_confidence_values(text)
        if not values or values[0].value == 0:
            return UNKNOWN
        return values[0].language.iso_code_639_1.name.lower(), values[0].value


class LangdetectDetector:
    def __init__(self, seed: int = 0) -> None:
        require("langdetect", "data").DetectorFactory.seed = seed

    def detect(self, text: str) -> tuple[str, float]:
        from langdetect import LangDetectException, detect_langs

        try:
            best = detect_langs(text)[0]
        except LangDetectException:  # no letters to judge by
            return UNKNOWN
        return best.lang.split("-")[0], best.prob


class FastTextDetector:
    def __init__(self, model_path: str) -> None:
        try:
            import fasttext
        except ImportError:
            raise UserError(
                "the fasttext language detector needs the `fasttext` package: pip install fasttext"
            ) from None
        try:
            self._model = fasttext.load_model(str(model_path))
        except ValueError as e:
            raise UserError(f"cannot load the fastText language model {model_path}: {e}") from None

    def detect(self, text: str) -> tuple[str, float]:
        labels, scores = self._model.predict(text.replace("\n", " "), k=1)
        if not labels:
            return UNKNOWN
        return labels[0].removeprefix("__label__"), float(scores[0])


DETECTORS = {
    "cld2": CLD2Detector,
    "lingua": LinguaDetector,
    "langdetect": LangdetectDetector,
    "fasttext": FastTextDetector,
}


def load_detector(name: str, **options: Any) -> Any:
    if name in DETECTORS:
        return DETECTORS[name](**options)
    module, _, cls = name.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)(**options)
    except (ImportError, AttributeError, ValueError):
        raise UserError(
            f"unknown language detector {name!r}: use one of {sorted(DETECTORS)} or 'module:Class'"
        ) from None


def language_filter(
    languages: Iterable[str] | None = ("en",),
    threshold: float = 0.65,
    detector: str = "cld2",
    max_chars: int = 2000,
    thresholds: dict | None = None,
    **detector_options: Any,
) -> Stage:
    """Stage factory: keep documents whose most likely language is in `languages` (all, if empty)
    with a score >= `threshold`, or >= `thresholds[language]` where given (FineWeb: English >= 0.65;
    CLD2 gives Chinese prose with Latin command names and product names ~0.5-0.8, so a Chinese
    config sets zh: 0.5). The language and score go into `doc.meta`.
    Only the first `max_chars` characters are looked at: more rarely changes the answer."""
    model = load_detector(detector, **detector_options)
    targets = set(languages or ())
    minimum = {str(code): float(value) for code, value in (thresholds or {}).items()}

    def language(doc: Document, counts: Counter) -> str | None:
        lang, score = model.detect(doc.text[:max_chars])
        doc.meta["language"], doc.meta["language_score"] = lang, round(score, 4)
        if targets and lang not in targets:
            return "other_language"
        if score < minimum.get(lang, threshold):
            return "low_language_score"
        return None

    return language
