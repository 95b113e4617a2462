"""llmstack: raw text to a trained model that Hugging Face transformers loads.

`import llmstack` registers llmstack's model types with transformers' Auto classes, so that
`AutoModelForCausalLM.from_pretrained(...)` loads an llmstack model directory, whichever of the two
is imported first, without loading transformers itself (llmstack.compat.auto_registration): `import
llmstack` and `llmstack --help` load neither transformers nor DeepSpeed. The model classes below
are imported on first use.
"""

import importlib
from typing import Any

from llmstack.compat.auto_registration import install as _register_with_auto_classes

__version__ = "0.1.0"
__all__ = ["LLMStackConfig", "LLMStackForCausalLM", "from_llama", "to_llama", "__version__"]

_register_with_auto_classes()


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("llmstack.models"), name)
    raise AttributeError(f"module 'llmstack' has no attribute {name!r}")
