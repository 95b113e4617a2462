"""Supervised fine-tuning through the pretraining Trainer: full, LoRA or prompt tuning.

The run config is a pretraining one whose data.train/valid are prompt/response JSONL files; the
model comes from the base model (its weights and its tokenizer), so the config has no model
section. The Trainer runs the DeepSpeed loop, eval and checkpoints as for pretraining. At the end
the result is saved ready to use: OUT_DIR/model (full) or OUT_DIR/adapter (LoRA, prompt tuning;
fold LoRA into the base with `llmstack merge-lora`).
"""

import json
import os
from typing import TYPE_CHECKING, Any, cast

import deepspeed
import torch.distributed as dist
from transformers import LlamaForCausalLM, PreTrainedModel

from llmstack.data.tokenizer import load_tokenizer
from llmstack.errors import UserError
from llmstack.models import LLMStackForCausalLM, from_llama, to_llama

from ..config import RunConfig
from ..loading import load_model, tokenizer_dir
from ..trainer import Trainer, seed_everything
from .lora import add_lora, add_prompt_tuning, peft
from .sft import SFTData

if TYPE_CHECKING:
    from peft import PeftModel

METHODS = ("full", "lora", "prompt")


def prepare_model(
    model: PreTrainedModel,
    method: str,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    num_virtual_tokens: int = 16,
) -> "PreTrainedModel | PeftModel":
    """The model to train: `model` itself (full) or a peft model training only the adapter."""
    if method == "full":
        return model
    if method == "lora":
        return add_lora(model, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
    if method == "prompt":
        return add_prompt_tuning(model, num_virtual_tokens=num_virtual_tokens)
    raise UserError(f"fine-tuning method must be one of {', '.join(METHODS)}; got {method!r}")


def finetune(
    run: RunConfig,
    base_model: str,
    method: str = "lora",
    ds_config_path: str | None = None,
    resume: str | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
    **adapter: Any,
) -> str:
    """Fine-tune `base_model` on run.data's JSONL pairs; returns the directory of the result."""
    if run.model:
        raise UserError("fine-tuning takes the model from the base model; remove the config's model section")
    base = load_model(base_model, causal=True)
    llama_base = isinstance(base, LlamaForCausalLM)
    base = from_llama(base) if llama_base else base
    run.data.tokenizer = tokenizer_dir(base_model)
    tokenizer = load_tokenizer(run.data.tokenizer)
    data: dict[str, Any] = dict(
        tokenizer=tokenizer,
        seq_len=run.data.seq_len,
        seed=run.data.seed,
        prompt_field=prompt_field,
        response_field=response_field,
    )
    seed_everything(run.train.seed)  # the same adapter initialization on every rank
    trainer = Trainer(
        run,
        ds_config_path,
        model=prepare_model(base, method, **adapter),
        train_data=SFTData(run.data.train, **data),
        valid_data=SFTData(run.data.valid, shuffle=False, **data) if run.data.valid else None,
    )
    if resume:
        trainer.resume(resume)
    trainer.train()
    out_dir = os.path.join(run.train.out_dir, "model" if method == "full" else "adapter")
    save_trained(trainer, out_dir, base_model, llama_base)
    return out_dir


def save_trained(trainer: Trainer, out_dir: str, base_model: str, llama_base: bool = False) -> None:
    """Rank 0 writes the trained module (a plain model, or a peft adapter) and the tokenizer;
    ZeRO-3 partitions are gathered first."""
    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        if trainer.rank == 0:
            save_in_base_format(module, out_dir, base_model, llama_base)
            trainer.tokenizer.save_pretrained(out_dir)
    dist.barrier()


def save_in_base_format(
    module: "LLMStackForCausalLM | PeftModel", out_dir: str, base_model: str, llama_base: bool = False
) -> None:
    """Save so that stock tools load the result offline: a full model in its base's format (a
    Llama base gives a Llama model), an adapter whose config names its base model's directory
    (for `peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`).

    The adapter's base is written into adapter_config.json after saving: peft, given the path
    before, reloads the base's config with the trained model's config class, which fails for a
    Llama base trained as an llmstack model.
    """
    if not isinstance(module, peft.PeftModel):
        plain = cast("LLMStackForCausalLM", module)
        (to_llama(plain) if llama_base else plain).save_pretrained(out_dir)
        return
    module.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = os.path.abspath(base_model)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
