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


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Within the block every torch.load is weights_only, even when the caller asks otherwise.

    DeepSpeed's data classes join torch's allowlist for good (torch's own `safe_globals` context
    is not reentrant, and these classes are safe to rebuild anywhere)."""
    from llmstack.compat.deepspeed import checkpoint_state_classes

    torch.serialization.add_safe_globals(checkpoint_state_classes())  # type: ignore[arg-type]  # reads a list[type]
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def load_tensors(path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu") -> Any:
    """torch.load of one checkpoint file, safely (see safe_loading). The file is memory-mapped
    (privately: writes to the tensors never reach it), which spares one copy of every tensor."""
    with safe_loading():
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
