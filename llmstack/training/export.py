"""Turn a training checkpoint (any ZeRO stage) or a saved model into a Hugging Face model directory."""

import os

import torch

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM, to_llama

FORMATS = ("llmstack", "llama")


def is_model_dir(path):
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path)
    )


def checkpoint_root_and_tag(path):
    """(directory holding config.json and `latest`, tag or None) for a checkpoint root or one tag in it."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    parent = os.path.dirname(path)
    if os.path.isfile(os.path.join(parent, "config.json")) and os.path.isdir(path):
        return parent, os.path.basename(path)
    raise UserError(
        f"{path} is neither a model directory (config.json + *.safetensors) nor a training checkpoint "
        "(OUT_DIR/checkpoints or OUT_DIR/checkpoints/global_stepN)"
    )


def consolidated_state_dict(root, tag=None):
    """Full fp32 weights from DeepSpeed's shards, through DeepSpeed's own zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if tag is None:
        with open(os.path.join(root, "latest")) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(root, tag)
    if not os.path.isdir(tag_dir):
        raise UserError(f"checkpoint {tag_dir} not found")
    if any(name.endswith("optim_states.pt") for name in os.listdir(tag_dir)):
        return get_fp32_state_dict_from_zero_checkpoint(root, tag)
    # ZeRO stage 0 keeps the whole model in one file.
    states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}


def load_trained_model(path):
    """An LLMStackForCausalLM (fp32, eval mode) from a model directory or a training checkpoint."""
    if not os.path.exists(path):
        raise UserError(f"{path} not found")
    if is_model_dir(path):
        return LLMStackForCausalLM.from_pretrained(path).eval()
    root, tag = checkpoint_root_and_tag(path)
    model = LLMStackForCausalLM(LLMStackConfig.from_pretrained(root))
    missing, unexpected = model.load_state_dict(consolidated_state_dict(root, tag), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise UserError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def export_hf(path, out_dir, fmt="llmstack"):
    """Write a Hugging Face directory: llmstack format (needs `import llmstack`) or Llama format
    (loads in stock transformers). The tokenizer is copied when the source has one."""
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}")
    model = load_trained_model(path)
    try:
        out_model = to_llama(model) if fmt == "llama" else model
    except ValueError as e:
        raise UserError(str(e)) from None
    out_model.save_pretrained(out_dir)
    tokenizer_dir = path if is_model_dir(path) else checkpoint_root_and_tag(path)[0]
    if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir
