"""Hugging Face-compatible model definitions, registered with the Auto classes on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

from .configuration_encoder import LLMStackEncoderConfig
from .configuration_llmstack import LLMStackConfig
from .configuration_t5 import LLMStackT5Config
from .embedding import LLMStackEmbeddingConfig, LLMStackForEmbedding
from .hf_interop import FAMILIES, from_hf, from_hf_config, from_llama, to_hf, to_hf_config, to_llama
from .modeling_encoder import LLMStackEncoderModel, LLMStackForMaskedLM, model_for
from .modeling_llmstack import LLMStackForCausalLM, LLMStackModel
from .modeling_t5 import LLMStackForSpanCorruption
from .multitask import LLMStackForMultitask, LLMStackMultitaskConfig

AutoConfig.register(LLMStackConfig.model_type, LLMStackConfig, exist_ok=True)
AutoModel.register(LLMStackConfig, LLMStackModel, exist_ok=True)
AutoModelForCausalLM.register(LLMStackConfig, LLMStackForCausalLM, exist_ok=True)
AutoConfig.register(LLMStackEncoderConfig.model_type, LLMStackEncoderConfig, exist_ok=True)
AutoModel.register(LLMStackEncoderConfig, LLMStackEncoderModel, exist_ok=True)
AutoModelForMaskedLM.register(LLMStackEncoderConfig, LLMStackForMaskedLM, exist_ok=True)
AutoConfig.register(LLMStackEmbeddingConfig.model_type, LLMStackEmbeddingConfig, exist_ok=True)
AutoModel.register(LLMStackEmbeddingConfig, LLMStackForEmbedding, exist_ok=True)
AutoConfig.register(LLMStackMultitaskConfig.model_type, LLMStackMultitaskConfig, exist_ok=True)
AutoModel.register(LLMStackMultitaskConfig, LLMStackForMultitask, exist_ok=True)
AutoConfig.register(LLMStackT5Config.model_type, LLMStackT5Config, exist_ok=True)
AutoModelForSeq2SeqLM.register(LLMStackT5Config, LLMStackForSpanCorruption, exist_ok=True)

__all__ = [
    "FAMILIES",
    "LLMStackConfig",
    "LLMStackEmbeddingConfig",
    "LLMStackEncoderConfig",
    "LLMStackEncoderModel",
    "LLMStackForEmbedding",
    "LLMStackForCausalLM",
    "LLMStackForMaskedLM",
    "LLMStackForMultitask",
    "LLMStackForSpanCorruption",
    "LLMStackModel",
    "LLMStackMultitaskConfig",
    "LLMStackT5Config",
    "from_hf",
    "from_hf_config",
    "from_llama",
    "model_for",
    "to_hf",
    "to_hf_config",
    "to_llama",
]
