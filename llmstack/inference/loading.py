"""Load a model and its tokenizer for inference from wherever training left them."""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import llmstack.models  # noqa: F401  (registers the llmstack model with the Auto classes)
from llmstack.errors import UserError
from llmstack.training.export import checkpoint_root_and_tag, is_model_dir, load_trained_model


def load_model_and_tokenizer(path, device=None):
    """(model in eval mode, tokenizer) from a Hugging Face model directory (llmstack or Llama
    format, e.g. from `llmstack export-hf` or `merge-lora`) or a training checkpoint
    (OUT_DIR/checkpoints[/global_stepN]). `device` defaults to CUDA when there is one."""
    if not os.path.exists(path):
        raise UserError(f"model {path} not found")
    if is_model_dir(path):
        model, tokenizer_dir = AutoModelForCausalLM.from_pretrained(path), path
    else:
        model, tokenizer_dir = load_trained_model(path), checkpoint_root_and_tag(path)[0]
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer_config.json")):
        raise UserError(f"{tokenizer_dir} has no tokenizer; copy the training tokenizer's files into it")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(tokenizer_dir)
