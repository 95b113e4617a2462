"""The gradient compressor's error feedback in a checkpoint: one file per rank, since every rank
keeps the residuals of its own gradients (`compression_rank{R}.pt` beside DeepSpeed's files)."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmstack.optim import gradient_compressor
from llmstack.safe_load import load_tensors


def compression_file(tag_dir: str | Path, rank: int) -> Path:
    return Path(tag_dir) / f"compression_rank{rank}.pt"


def save_compression_state(engine: Any, tag_dir: str | Path, save: Callable[[Any, str], Any] = torch.save) -> None:
    """Write this rank's error feedback into `tag_dir` with `save(obj, path)` (nothing without a
    compressor)."""
    compressor = gradient_compressor(engine)
    if compressor is not None:
        save(compressor.state_dict(), str(compression_file(tag_dir, dist.get_rank())))


def load_compression_state(engine: Any, tag_dir: str | Path) -> bool:
    """Restore this rank's error feedback from `tag_dir`; False (residuals start at zero) when the
    checkpoint has none for this rank."""
    compressor = gradient_compressor(engine)
    path = compression_file(tag_dir, dist.get_rank())
    if compressor is None or not path.exists():
        return False
    compressor.load_state_dict(load_tensors(path))
    return True
