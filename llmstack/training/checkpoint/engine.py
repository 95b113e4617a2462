"""The DeepSpeed checkpoint engine llmstack installs: DeepSpeed decides what each rank saves,
this decides how the files are written and read.

Compared with DeepSpeed's TorchCheckpointEngine:
- every file is checksummed as it is written and recorded, for the manifest;
- a failed write (disk full, I/O error) is recorded instead of raised, so that every rank still
  reaches DeepSpeed's barriers and the ranks decide together that the checkpoint failed;
- with `background=True`, `save()` only serializes the state into memory, which is all training
  waits for, and one writer thread puts the bytes on disk;
- `load()` reads with `torch.load(weights_only=True)` (see llmstack.safe_load).
"""

import io
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from llmstack.compat.deepspeed import checkpoint_engine_base
from llmstack.safe_load import load_tensors

from .files import write_file


class ManifestCheckpointEngine(checkpoint_engine_base()):  # type: ignore[misc]  # DeepSpeed's CheckpointEngine
    def __init__(self, background: bool = False) -> None:
        super().__init__()
        self.name = "llmstack"
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if background else None
        self._written: dict[str, dict[str, int | str]] = {}  # path -> manifest entry
        self._errors: list[str] = []

    def create(self, info: Any) -> None:
        pass

    def commit(self, info: Any) -> bool:
        return True

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        self.write(path, lambda f: torch.save(state_dict, f))

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_tensors(path, map_location=map_location)

    def write(self, path: str, serialize: Callable[[Any], object]) -> None:
        """Write one file of the checkpoint being saved: `serialize(file)` writes its bytes."""
        if self._writer is None:
            self._write(path, serialize)
            return
        try:
            buffer = io.BytesIO()
            serialize(buffer)  # the in-memory copy: training waits for this, not for the disk
        except Exception as e:  # noqa: BLE001  (reported by finish(), on every rank)
            self._errors.append(f"{path}: {e}")
            return
        self._writer.submit(self._write, path, lambda f: f.write(buffer.getbuffer()))

    def _write(self, path: str, serialize: Callable[[Any], object]) -> None:
        try:
            self._written[path] = write_file(path, serialize)
        except Exception as e:  # noqa: BLE001  (reported by finish(), on every rank)
            self._errors.append(f"{path}: {e}")

    def finish(self, commit: Callable[[dict[str, dict[str, int | str]], list[str]], list[str]]) -> Future[list[str]]:
        """Once this rank's files are on disk, call `commit(written, errors)`; returns a Future of
        its result. Synchronous engines call it now, background ones after their last write."""
        if self._writer is not None:
            return self._writer.submit(self._finish, commit)
        future: Future[list[str]] = Future()
        future.set_result(self._finish(commit))
        return future

    def _finish(self, commit: Callable[[dict[str, dict[str, int | str]], list[str]], list[str]]) -> list[str]:
        written, errors = self._written, self._errors
        self._written, self._errors = {}, []
        return commit(written, errors)
