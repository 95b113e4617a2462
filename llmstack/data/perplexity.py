"""Perplexity filter: keep documents a small reference language model finds likely enough
(CCNet-style). The model is any causal LM directory that `AutoModelForCausalLM` loads, an
llmstack model included (`import llmstack` registers it with the Auto classes), with its tokenizer
saved beside it."""

import math
from collections import Counter
from pathlib import Path

from llmstack.errors import UserError

from .document import Document, Stage


def perplexity_filter(
    model_path: str | Path, max_perplexity: float, max_tokens: int = 512, device: str = "cpu"
) -> Stage:
    """Stage factory: drop documents whose perplexity over their first `max_tokens` tokens is above
    `max_perplexity`; the perplexity goes into `doc.meta`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(model_path, "config.json").is_file():
        raise UserError(f"perplexity filter: {model_path} is not a model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()  # type: ignore[arg-type]  # @wraps'd .to

    @torch.no_grad()
    def perplexity(doc: Document, counts: Counter) -> str | None:
        ids = tokenizer(doc.text, return_tensors="pt").input_ids[:, :max_tokens].to(device)
        if ids.shape[1] < 2:
            counts["too_short_to_score"] += 1
            return None
        value = math.exp(model(input_ids=ids, labels=ids).loss.item())
        doc.meta["perplexity"] = round(value, 3)
        return "high_perplexity" if value > max_perplexity else None

    return perplexity
