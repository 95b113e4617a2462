"""llmstack: raw text to a trained model that Hugging Face transformers loads.

The model classes are imported on first use, so `import llmstack` and `llmstack --help` load
neither transformers nor DeepSpeed.
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLMStackConfig", "LLMStackForCausalLM", "from_llama", "to_llama", "__version__"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("llmstack.models"), name)
    raise AttributeError(f"module 'llmstack' has no attribute {name!r}")
