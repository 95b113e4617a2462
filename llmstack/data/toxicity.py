"""Toxicity filter: pluggable scorers, a threshold per label, drops counted by label.

A scorer is any object with `labels` (the labels it scores) and `scores(text) -> {label: p}`.
Built in:
- "profanity_check": alt-profanity-check (`pip install alt-profanity-check`): an English linear
  model of offensive language whose weights ship in the wheel; label `offensive`;
- "hf": any Hugging Face sequence-classification model directory (`model_path`), labels from its
  `config.id2label`, softmax over them (sigmoid for `problem_type: multi_label_classification`);
- "fasttext": a fastText supervised classifier file (`model_path`; `pip install fasttext-wheel`:
  the `fasttext` sdist and `fasttext-numpy2-wheel` 0.9.2/0.9.3 built here diverge to NaN in
  training on any input), labels without their `__label__` prefix.
Any other scorer: `scorer: "package.module:ClassName"`. Nothing is downloaded.
"""

import importlib
from collections import Counter
from pathlib import Path
from typing import Any

from llmstack.errors import UserError, require

from .document import Document, Stage


class ProfanityCheckScorer:
    labels = ("offensive",)

    def __init__(self) -> None:
        self._predict = require("profanity_check", "toxicity").predict_prob

    def scores(self, text: str) -> dict[str, float]:
        return {"offensive": float(self._predict([text])[0])}


class HFClassifierScorer:
    def __init__(self, model_path: str, max_tokens: int = 512, device: str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not Path(model_path, "config.json").is_file():
            raise UserError(f"toxicity scorer: {model_path} is not a model directory (no config.json)")
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._model = AutoModelForSequenceClassification.from_pretrained(model_path).to(device).eval()
        config = self._model.config
        self.labels = tuple(config.id2label[i] for i in range(config.num_labels))
        self._multi_label = config.problem_type == "multi_label_classification"
        self._max_tokens, self._device = max_tokens, device

    def scores(self, text: str) -> dict[str, float]:
        import torch

        inputs = self._tokenizer(text, truncation=True, max_length=self._max_tokens, return_tensors="pt")
        with torch.no_grad():
            logits = self._model(**inputs.to(self._device)).logits[0].float()
        probabilities = logits.sigmoid() if self._multi_label else logits.softmax(-1)
        return dict(zip(self.labels, probabilities.tolist()))


class FastTextScorer:
    def __init__(self, model_path: str) -> None:
        fasttext = require("fasttext", "toxicity")
        try:
            self._model = fasttext.load_model(str(model_path))
        except ValueError as e:
            raise UserError(f"cannot load the fastText classifier {model_path}: {e}") from None
        self.labels = tuple(label.removeprefix("__label__") for label in self._model.get_labels())

    def scores(self, text: str) -> dict[str, float]:
        # The binding's own predict: the wrapper's `predict` calls np.array(..., copy=False), which
        # NumPy 2 refuses (fasttext 0.9.2 and 0.9.3). Arguments: text, k (-1: every label),
        # threshold, on_unicode_error.
        pairs = self._model.f.predict(text.replace("\n", " "), -1, 0.0, "strict")
        return {label.removeprefix("__label__"): min(float(p), 1.0) for p, label in pairs}


SCORERS = {"profanity_check": ProfanityCheckScorer, "hf": HFClassifierScorer, "fasttext": FastTextScorer}


def load_scorer(name: str, **options: Any) -> Any:
    if name in SCORERS:
        return SCORERS[name](**options)
    module, _, cls = name.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)(**options)
    except (ImportError, AttributeError, ValueError):
        raise UserError(f"unknown toxicity scorer {name!r}: use one of {sorted(SCORERS)} or 'module:Class'") from None


def toxicity_filter(
    scorer: str = "profanity_check", thresholds: dict | None = None, max_chars: int = 4000, **scorer_options: Any
) -> Stage:
    """Stage factory: drop a document whose score for any label in `thresholds` ({label: minimum
    score to drop}; default: 0.5 for every label but the scorer's first when it has several, i.e.
    its "clean" class, and for its only label otherwise) reaches it; the reason is `toxic_LABEL`.
    The scores of the thresholded labels go into `doc.meta["toxicity"]`. Only the first
    `max_chars` characters are scored."""
    model = load_scorer(scorer, **scorer_options)
    labels = tuple(model.labels)
    if thresholds is None:
        thresholds = {label: 0.5 for label in (labels[1:] if len(labels) > 1 else labels)}
    if unknown := set(thresholds) - set(labels):
        raise UserError(f"toxicity thresholds name labels {sorted(unknown)} the scorer does not have: {list(labels)}")
    limits = {str(label): float(value) for label, value in thresholds.items()}

    def toxicity(doc: Document, counts: Counter) -> str | None:
        scores = model.scores(doc.text[:max_chars])
        doc.meta["toxicity"] = {label: round(scores.get(label, 0.0), 4) for label in limits}
        for label, limit in limits.items():
            if scores.get(label, 0.0) >= limit:
                return f"toxic_{label}"
        return None

    return toxicity
