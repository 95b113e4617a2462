"""Hugging Face-compatible model definitions, registered with the Auto classes on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_llmstack import LLMStackConfig
from .hf_interop import FAMILIES, from_hf, from_hf_config, from_llama, to_hf, to_hf_config, to_llama
from .modeling_llmstack import LLMStackForCausalLM, LLMStackModel

AutoConfig.register(LLMStackConfig.model_type, LLMStackConfig, exist_ok=True)
AutoModel.register(LLMStackConfig, LLMStackModel, exist_ok=True)
AutoModelForCausalLM.register(LLMStackConfig, LLMStackForCausalLM, exist_ok=True)

__all__ = [
    "FAMILIES",
    "LLMStackConfig",
    "LLMStackForCausalLM",
    "LLMStackModel",
    "from_hf",
    "from_hf_config",
    "from_llama",
    "to_hf",
    "to_hf_config",
    "to_llama",
]
