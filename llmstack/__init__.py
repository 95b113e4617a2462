"""llmstack: raw text to a trained model that Hugging Face transformers loads."""

from .models import LLMStackConfig, LLMStackForCausalLM, from_llama, to_llama

__version__ = "0.1.0"
__all__ = ["LLMStackConfig", "LLMStackForCausalLM", "from_llama", "to_llama", "__version__"]
