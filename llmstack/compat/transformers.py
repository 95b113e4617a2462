"""Every transformers internal llmstack's model uses, each behind one function, and the check that
the installed transformers has them and the API the model is written against.

Importing this module (llmstack.models does) runs `check_installed`, which stops with one
IncompatibleLibraryError naming the supported range.

The supported range: transformers 5.x from 5.24.0, below 6. 5.24.0 is the first release whose
`CausalLMOutputWithPast` has the `cache` field (5.0-5.23 call it `past_key_values`) that the model
returns and generation reads; `PreTrainedModel.activation_checkpointing_enable` arrived in 5.23.0.
Checked in the released wheels of 5.0.0, 5.6.2, 5.12.1, 5.18.0, 5.21.1, 5.23.0 and 5.24.0. Below 6,
which removes the names 5.x deprecates (gradient_checkpointing_enable, the past_key_values argument).
"""

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import SupportedRange, missing_attributes

SUPPORTED_TRANSFORMERS = SupportedRange("transformers", ">=5.24.0,<6")

# The functions of transformers.initialization the model's _init_weights calls: unlike
# torch.nn.init they leave alone the weights from_pretrained has already loaded.
INIT_FUNCTIONS = ("normal_", "xavier_uniform_", "ones_", "copy_")


def check_installed() -> None:
    """Stop with IncompatibleLibraryError unless the installed transformers is in the supported
    range and has what llmstack's model relies on."""
    SUPPORTED_TRANSFORMERS.check(transformers.__version__)
    SUPPORTED_TRANSFORMERS.check(transformers.__version__, installed_problems())


def installed_problems() -> list[str]:
    """What the installed transformers lacks of what llmstack uses (an empty list when nothing)."""
    missing = []
    try:
        missing += missing_attributes(
            importlib.import_module("transformers.initialization"),
            INIT_FUNCTIONS,
            "transformers.initialization",
        )
    except ImportError:
        missing.append("module transformers.initialization")
    if "cache" not in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}:
        missing.append("CausalLMOutputWithPast.cache")
    missing += missing_attributes(PreTrainedModel, ("activation_checkpointing_enable",), "PreTrainedModel")
    if "config" not in inspect.signature(DynamicCache.__init__).parameters:
        missing.append("DynamicCache(config=...)")
    return missing


def weight_init() -> ModuleType:
    """transformers.initialization: torch.nn.init's functions that skip already-loaded weights."""
    return importlib.import_module("transformers.initialization")


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute every decoder layer's activations in the backward pass (transformers'
    activation_checkpointing_enable), and check it took: each module it switched on must have the
    `_gradient_checkpointing_func` that `checkpointed_call` runs."""
    model.activation_checkpointing_enable()
    switched_on = [
        m for m in model.modules() if hasattr(m, "gradient_checkpointing") and m.gradient_checkpointing is True
    ]
    if not switched_on or not all(callable(_checkpoint_function(m)) for m in switched_on):
        error = SUPPORTED_TRANSFORMERS.error(
            transformers.__version__,
            ["activation_checkpointing_enable() setting gradient_checkpointing and _gradient_checkpointing_func"],
        )
        assert error is not None
        raise error


def _checkpoint_function(module: Any) -> Any:
    return module._gradient_checkpointing_func if hasattr(module, "_gradient_checkpointing_func") else None


def checkpointed_call(module: Any, function: Callable, *args: Any) -> Any:
    """function(*args) with its activations recomputed in the backward pass, by the checkpoint
    function activation_checkpointing_enable gave `module`."""
    return module._gradient_checkpointing_func(function, *args)


check_installed()
