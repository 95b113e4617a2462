"""Load a model and its tokenizer from wherever training left them: a Hugging Face model
directory (llmstack or Llama format, from `export-hf` or `merge-lora`) or a training checkpoint
(OUT_DIR/checkpoints[/global_stepN])."""

import os

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import llmstack.models  # noqa: F401  (registers the llmstack model with the Auto classes)
from llmstack.errors import UserError
from llmstack.models import LLMStackEmbeddingConfig, LLMStackForEmbedding

from .export import (
    MASKED_LM_MODEL_TYPES,
    SEQ2SEQ_MODEL_TYPES,
    checkpoint_root_and_tag,
    is_model_dir,
    load_trained_model,
    model_type,
)


def load_model(path: str, trust: bool = False, causal: bool = False) -> PreTrainedModel:
    """The causal LM (or masked LM: an encoder; an embedding model; an encoder-decoder) at `path`,
    on the CPU, in eval mode. `trust`: accept a training checkpoint that has no llmstack manifest.
    `causal`: refuse an encoder, before reading any weights (for commands that decode left to right)."""
    if not os.path.exists(path):
        raise UserError(f"model {path} not found")
    if causal and is_masked_lm(path):
        raise UserError(
            f"{path} is a masked-LM encoder; this command needs a causal language model (an encoder is "
            "used through `llmstack eval` or `export-hf --format eurobert`)"
        )
    if not is_model_dir(path):
        return load_trained_model(path, trust=trust).eval()
    if model_type(path) == LLMStackEmbeddingConfig.model_type:
        return LLMStackForEmbedding.from_pretrained(path).eval()
    if model_type(path) in SEQ2SEQ_MODEL_TYPES:
        return AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    auto = AutoModelForMaskedLM if model_type(path) in MASKED_LM_MODEL_TYPES else AutoModelForCausalLM
    return auto.from_pretrained(path).eval()


def is_masked_lm(path: str) -> bool:
    """Whether the model directory or training checkpoint at `path` holds an encoder, by its config.json."""
    directory = path if is_model_dir(path) else checkpoint_root_and_tag(path)[0]
    return os.path.isfile(os.path.join(directory, "config.json")) and model_type(directory) in MASKED_LM_MODEL_TYPES


def tokenizer_dir(path: str) -> str:
    """The directory holding the tokenizer of the model at `path`."""
    directory = path if is_model_dir(path) else checkpoint_root_and_tag(path)[0]
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        raise UserError(f"{directory} has no tokenizer; copy the training tokenizer's files into it")
    return directory


def load_model_and_tokenizer(
    path: str, device: str | torch.device | None = None, trust: bool = False, causal: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, tokenizer); `device` defaults to CUDA when there is one; `causal` as in load_model."""
    model = load_model(path, trust=trust, causal=causal)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device), AutoTokenizer.from_pretrained(tokenizer_dir(path))  # type: ignore[arg-type]  # transformers mistypes its wrapped .to()
