"""Training: run config, the DeepSpeed loop, checkpoints, evaluation, fine-tuning, export.

`Trainer` is imported on first use, so importing a light module here (the run config, the
checkpoint files) does not load DeepSpeed.
"""

import importlib
from typing import Any

__all__ = ["RunConfig", "Trainer", "load_run_config"]

_HOMES = {"RunConfig": ".config", "load_run_config": ".config", "Trainer": ".trainer"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module 'llmstack.training' has no attribute {name!r}")
