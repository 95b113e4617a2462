"""llmstack's model types registered with transformers' Auto classes, without loading transformers
on `import llmstack`.

If transformers' Auto models are loaded already, llmstack.models (which registers its classes on
import) is imported at once. Otherwise an import hook waits for `transformers.models.auto.modeling_auto`
and, once it has run, wraps the Auto classes' entry points (`from_pretrained`, `from_config`,
`AutoConfig.for_model`) so that the first call imports llmstack.models, puts the originals back and
goes on. The registration waits for a call rather than running inside the import: transformers
loads its Auto models in the middle of other imports (`from transformers import LlamaForCausalLM`
loads them half-way through modeling_llama), and llmstack.models imports those very classes.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

AUTO_MODELS = "transformers.models.auto.modeling_auto"
AUTO_CONFIG = "transformers.models.auto.configuration_auto"
ENTRY_POINTS = ("from_pretrained", "from_config", "for_model")


def register_auto_classes() -> None:
    importlib.import_module("llmstack.models")  # registers on import


def register_on_first_use(auto_models: ModuleType) -> None:
    """Wrap the entry points of every Auto class of `auto_models` (and AutoConfig's) so that the
    first call registers llmstack's classes and restores them."""
    base = auto_models._BaseAutoModelClass
    classes = [c for c in vars(auto_models).values() if isinstance(c, type) and issubclass(c, base)]
    classes.append(sys.modules[AUTO_CONFIG].AutoConfig)
    originals = {(cls, name): cls.__dict__[name] for cls in classes for name in ENTRY_POINTS if name in cls.__dict__}

    def restore_and_register() -> None:
        for (cls, name), method in originals.items():
            setattr(cls, name, method)
        register_auto_classes()

    def first_call(name: str) -> Callable[..., Any]:
        def call(cls: type, *args: Any, **kwargs: Any) -> Any:
            restore_and_register()
            return getattr(cls, name)(*args, **kwargs)

        return call

    for cls, name in originals:
        setattr(cls, name, classmethod(first_call(name)))


class _AfterLoading(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        register_on_first_use(module)


class _AutoModelsHook(importlib.abc.MetaPathFinder):
    """Finds transformers' Auto-model module as the other finders do, with a loader that wraps its
    entry points once it has run; then leaves sys.meta_path."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != AUTO_MODELS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterLoading(spec.loader)
        return spec


def install() -> None:
    """Register now if transformers' Auto models are loaded, else on their first use."""
    if AUTO_MODELS in sys.modules:
        register_auto_classes()
    elif not any(isinstance(finder, _AutoModelsHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AutoModelsHook())
