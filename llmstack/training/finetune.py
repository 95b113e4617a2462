"""Supervised fine-tuning through the pretraining Trainer: full, LoRA or prompt tuning.

The run config is a pretraining one whose data.train/valid are prompt/response JSONL files; the
model comes from the base model (its weights and its tokenizer), so the config has no model
section. The Trainer runs the DeepSpeed loop, eval and checkpoints as for pretraining. At the end
the result is saved ready to use: OUT_DIR/model (full) or OUT_DIR/adapter (LoRA, prompt tuning;
fold LoRA into the base with `llmstack merge-lora`).
"""

import os

import deepspeed
import torch.distributed as dist
from transformers import LlamaForCausalLM

from llmstack.data.tokenizer import load_tokenizer
from llmstack.errors import UserError
from llmstack.models import from_llama
from .trainer import Trainer
from .trainer import seed_everything

from .loading import load_model, tokenizer_dir
from .lora import add_lora, add_prompt_tuning
from .sft import SFTData

METHODS = ("full", "lora", "prompt")


def prepare_model(model, method, lora_rank=8, lora_alpha=16, lora_dropout=0.05, num_virtual_tokens=16):
    """The model to train: `model` itself (full) or a peft model training only the adapter."""
    if method == "full":
        return model
    if method == "lora":
        return add_lora(model, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
    if method == "prompt":
        return add_prompt_tuning(model, num_virtual_tokens=num_virtual_tokens)
    raise UserError(f"fine-tuning method must be one of {', '.join(METHODS)}; got {method!r}")


def finetune(run, base_model, method="lora", ds_config_path=None, resume=None,
             prompt_field="prompt", response_field="response", **adapter):
    """Fine-tune `base_model` on run.data's JSONL pairs; returns the directory of the result."""
    if run.model:
        raise UserError("fine-tuning takes the model from the base model; remove the config's model section")
    base = load_model(base_model)
    base = from_llama(base) if isinstance(base, LlamaForCausalLM) else base
    run.data.tokenizer = tokenizer_dir(base_model)
    tokenizer = load_tokenizer(run.data.tokenizer)
    data = dict(tokenizer=tokenizer, seq_len=run.data.seq_len, seed=run.data.seed,
                prompt_field=prompt_field, response_field=response_field)
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
    save_trained(trainer, out_dir)
    return out_dir


def save_trained(trainer, out_dir):
    """Rank 0 writes the trained module (a plain model, or a peft adapter) and the tokenizer;
    ZeRO-3 partitions are gathered first."""
    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        if trainer.rank == 0:
            module.save_pretrained(out_dir)
            trainer.tokenizer.save_pretrained(out_dir)
    dist.barrier()
