"""Loading torch checkpoint files without unpickling code.

`safe_loading()` forces `weights_only` on every `torch.load` in its block, DeepSpeed's own loaders
included (they pass `weights_only=False`), with the few plain-data classes DeepSpeed pickles on
torch's allowlist. Used by checkpoint resume, export and the tensor/pipeline-parallel merge.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch


def deepspeed_state_classes() -> list[type]:
    """Non-container classes DeepSpeed pickles into its checkpoints; plain data, safe to rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Within the block every torch.load is weights_only, even when the caller asks otherwise.

    DeepSpeed's data classes join torch's allowlist for good (torch's own `safe_globals` context
    is not reentrant, and these classes are safe to rebuild anywhere)."""
    torch.serialization.add_safe_globals(deepspeed_state_classes())  # type: ignore[arg-type]  # reads a list[type]
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def load_tensors(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> Any:
    """torch.load of one checkpoint file, safely (see safe_loading). The file is memory-mapped
    (privately: writes to the tensors never reach it), which spares one copy of every tensor."""
    with safe_loading():
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
