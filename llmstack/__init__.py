"""llmstack: raw text to a trained model that Hugging Face transformers loads.

`import llmstack` registers llmstack's model types with transformers' Auto classes, so that
`AutoModelForCausalLM.from_pretrained(...)` loads an llmstack model directory, whichever of the two
is imported first. It does so without loading transformers itself: if transformers' Auto models
are loaded already, the registration happens now; otherwise once they load (an import hook), so
`import llmstack` and `llmstack --help` load neither transformers nor DeepSpeed. The model classes
below are imported on first use.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLMStackConfig", "LLMStackForCausalLM", "from_llama", "to_llama", "__version__"]

# Every AutoModel* class lives here; it is loaded on the first use of any of them.
_AUTO_MODELS = "transformers.models.auto.modeling_auto"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("llmstack.models"), name)
    raise AttributeError(f"module 'llmstack' has no attribute {name!r}")


def _register_auto_classes() -> None:
    importlib.import_module("llmstack.models")  # registers on import


class _RegisterAfterLoading(importlib.abc.Loader):
    """Runs the wrapped loader, then registers llmstack's classes with the just-loaded Auto classes."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register_auto_classes()


class _AutoModelsHook(importlib.abc.MetaPathFinder):
    """Finds transformers' Auto-model module as the other finders do, with a loader that
    registers llmstack's classes once it has run; then leaves sys.meta_path."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _AUTO_MODELS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterLoading(spec.loader)
        return spec


if _AUTO_MODELS in sys.modules:
    _register_auto_classes()
elif not any(isinstance(finder, _AutoModelsHook) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AutoModelsHook())
