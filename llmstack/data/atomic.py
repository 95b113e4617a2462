"""Files that appear complete or not at all: write to a temporary name, then rename."""

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_MARK = ".tmp-"


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; it becomes `path` only if the block finishes."""
    path = Path(path)
    temp = path.with_name(f"{path.name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}")  # unique across nodes
    try:
        yield temp
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def remove_temporaries(directory: Path | str, name: str = "") -> None:
    """Delete what a killed job left half-written under `directory` (only the files whose final
    name starts with `name`, when given: a task cleans up after itself, not after others)."""
    for temp in Path(directory).rglob(f"{name}*{TEMP_MARK}*"):
        temp.unlink(missing_ok=True)
