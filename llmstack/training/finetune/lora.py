"""Parameter-efficient fine-tuning through `peft`: LoRA on the attention and MLP projections,
or prompt tuning, with the adapter saved apart from the base model and LoRA mergeable into it."""

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import llmstack.models  # noqa: F401  (registers the llmstack model with the Auto classes)
from llmstack.errors import UserError, require

if TYPE_CHECKING:
    from peft import PeftModel

peft = require("peft", "finetune")  # a missing peft is one line naming the extra

# Attention and MLP projections; a GELU MLP has no gate_proj, and peft skips names it lacks.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(
    model: nn.Module, rank: int = 8, alpha: int = 16, dropout: float = 0.05, targets: Iterable[str] = LORA_TARGETS
) -> "PeftModel":
    """Freeze `model` and wrap it in a peft model whose only trainable weights are LoRA
    adapters (B @ A scaled by alpha / rank) on the `targets` projections."""
    config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets)
    )
    return peft.get_peft_model(model, config)


def add_prompt_tuning(model: nn.Module, num_virtual_tokens: int = 16) -> "PeftModel":
    """Freeze `model` and learn `num_virtual_tokens` soft-prompt embeddings prepended to every input."""
    return peft.get_peft_model(
        model, peft.PromptTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=num_virtual_tokens)
    )


def merge_lora(base_dir: str, adapter_dir: str, out_dir: str) -> PreTrainedModel:
    """Fold the LoRA adapter in `adapter_dir` into the model in `base_dir` and save a plain model
    (and the base model's tokenizer, if it has one) to `out_dir`."""
    for path, what in ((base_dir, "base model"), (adapter_dir, "adapter")):
        if not os.path.isdir(path):
            raise UserError(f"{what} directory {path} not found")
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise UserError(
            f"{adapter_dir} has no adapter_config.json; give the directory `llmstack finetune` saved the adapter to"
        )
    adapter_type = peft.PeftConfig.from_pretrained(adapter_dir).peft_type
    if adapter_type != "LORA":
        raise UserError(
            f"{adapter_dir} holds a {adapter_type} adapter; only LoRA adapters can be merged into the weights"
        )
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    merged = peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    if os.path.isfile(os.path.join(base_dir, "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return merged
