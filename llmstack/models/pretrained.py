"""Pretrained model directories (llmstack's own, or a supported Hugging Face family's), read one
tensor at a time so that nothing needs the whole model in memory to load it.

    config = pretrained_config(path)          # an LLMStackConfig, whichever the directory's family
    weights = PretrainedWeights(path)         # weights[name] reads one tensor from its safetensors file
    load_pretrained_weights(model, path)      # fill a whole model

Llama, Mistral and Qwen2 use llmstack's parameter names, so one reader serves all of them; a saved
Mixtral keeps its experts one tensor each, which the reader stacks (`mixtral_saved_layout`).
"""

import json
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .modeling_llmstack import LLMStackPreTrainedModel

from .configuration_encoder import LLMStackEncoderConfig
from .configuration_llmstack import LLMStackConfig
from .hf_interop import FAMILIES, from_hf_config, mixtral_saved_layout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_pretrained_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, SINGLE_FILE)) or os.path.isfile(os.path.join(path, INDEX_FILE))
    )


def pretrained_config(path: str) -> LLMStackConfig:
    """The llmstack config of model directory `path`; ValueError if its family is not supported or
    uses a feature llmstack does not implement."""
    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type == LLMStackConfig.model_type:
        return LLMStackConfig.from_pretrained(path)
    if model_type == LLMStackEncoderConfig.model_type:
        return LLMStackEncoderConfig.from_pretrained(path)
    if model_type not in FAMILIES:
        supported = ", ".join([LLMStackConfig.model_type, LLMStackEncoderConfig.model_type, *FAMILIES])
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}")
    return from_hf_config(AutoConfig.from_pretrained(path))


class PretrainedWeights:
    """The tensors of a safetensors model directory (one file or an indexed set of shards)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
        else:
            file = os.path.join(path, SINGLE_FILE)
            with safe_open(file, framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), file)

    def names(self) -> set[str]:
        return set(self.file_of)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # Opened per tensor: a file kept mapped would count its pages read so far in this
        # process's resident memory until the end of loading.
        with safe_open(self.file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    def check_names(self, config: LLMStackConfig, model_names: set[str]) -> None:
        """ValueError unless the files hold exactly `model_names` (lm_head may be absent when tied)."""
        stored = {self.stored_name(name, config): name for name in model_names}
        missing = {name for stored_names, name in stored.items() if not set(stored_names) <= self.names()}
        if config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        unexpected = self.names() - {n for stored_names in stored for n in stored_names}
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the config: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )

    def stored_name(self, name: str, config: LLMStackConfig) -> tuple[str, ...]:
        """The names in the files that parameter `name` is read from."""
        layout = None if name in self.file_of else mixtral_saved_layout(name, config.num_local_experts)
        if layout is None:
            return (name,)
        return (layout,) if isinstance(layout, str) else tuple(n for parts in layout for n in parts)

    def tensor_for(self, name: str, config: LLMStackConfig) -> torch.Tensor:
        """The tensor of parameter `name`, lm_head read from the embedding when the files tie them,
        Mixtral's per-expert tensors stacked."""
        if name == "lm_head.weight" and name not in self.file_of and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        layout = None if name in self.file_of else mixtral_saved_layout(name, config.num_local_experts)
        if isinstance(layout, list):
            return torch.stack([torch.cat([self[part] for part in parts]) for parts in layout])
        return self[layout or name]


def load_pretrained_weights(model: "LLMStackPreTrainedModel", path: str) -> None:
    """Copy every parameter of `model` (a whole llmstack decoder or encoder) from directory `path`, in place."""
    weights = PretrainedWeights(path)
    state = model.state_dict()
    weights.check_names(model.config, set(state))
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(weights.tensor_for(name, model.config))
