"""The files of a checkpoint: checksummed while written, listed in a manifest, verified before
use (and read back without unpickling code: llmstack.safe_load).

A manifest (`manifest.json`) maps every file of a checkpoint directory, by relative path, to
its size and CRC-32. A checkpoint whose files disagree with it (truncated, corrupt, missing) is
never loaded, nor is one whose manifest cannot be read; one without a manifest was not written by
llmstack (or its save never finished) and is loaded only when the user says it is trusted. The
manifest guards against accidents, not attackers (who could rewrite it too), so the checksum is
the fast CRC-32 (about 3x SHA-256's speed), not a cryptographic hash; safety against malicious
files comes from the loading.
"""

import json
import os
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from llmstack.data.atomic import atomic_path

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
NO_MANIFEST = "no manifest.json (not written by llmstack, or its save never finished)"
READ_CHUNK = 1 << 24
CHECK_THREADS = 4


class ChecksummingWriter:
    """A write-only file object that checksums and counts the bytes passing through it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.crc32 = 0
        self.bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def write_file(path: str | os.PathLike[str], serialize: Callable[[Any], object]) -> dict[str, int | str]:
    """Create `path`, let `serialize(file)` write it, flush it to the disk; returns its manifest entry."""
    with open(path, "wb") as f:
        writer = ChecksummingWriter(f)
        serialize(writer)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": writer.bytes, "crc32": f"{writer.crc32:08x}"}


LATEST_FILE = "latest"  # in a checkpoint directory: the tag of the newest complete checkpoint


def read_latest(directory: str) -> str | None:
    """The tag `directory`'s `latest` file names, or None when it has none."""
    try:
        with open(os.path.join(directory, LATEST_FILE)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def write_durable(path: str, data: bytes) -> None:
    """Replace `path` with `data` (bytes) atomically and durably: readers see the old or the new file."""
    with atomic_path(path) as temp:
        write_file(temp, lambda f: f.write(data))
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Make renames and new names in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str, files: Mapping[str, Mapping[str, int | str]]) -> None:
    body = {"version": MANIFEST_VERSION, "files": dict(sorted(files.items()))}
    write_durable(os.path.join(directory, MANIFEST), json.dumps(body, indent=1).encode())


class CorruptManifest(ValueError):
    """A manifest.json that exists but cannot be read as one: its checkpoint cannot be verified."""


def has_manifest(directory: str) -> bool:
    """Whether the save of checkpoint `directory` finished (the manifest is written last)."""
    return os.path.isfile(os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> dict | None:
    """The `files` of `directory`'s manifest ({name: {"bytes", "crc32"}}), or None when there is
    none; raises CorruptManifest when there is one that cannot be read."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptManifest(corrupt_manifest(f"{type(e).__name__}: {e}")) from e
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str)
        for entry in files.values()
    ):
        raise CorruptManifest(corrupt_manifest("its file list is malformed"))
    return files


def corrupt_manifest(reason: str) -> str:
    return (
        f"manifest.json cannot be read ({reason}), so the checkpoint cannot be verified and is not loaded, "
        "even with --trust-checkpoint (which accepts only a missing manifest)"
    )


def file_problems(directory: str, files: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What is wrong with the listed files of `directory` (an empty list when they all match).
    Files are checked in parallel threads: reading and CRC-32 both release the GIL."""
    with ThreadPoolExecutor(max_workers=CHECK_THREADS) as pool:
        found = pool.map(lambda item: file_problem(os.path.join(directory, item[0]), *item), files.items())
    return [problem for problem in found if problem]


def file_problem(path: str, name: str, expected: Mapping[str, Any]) -> str | None:
    if not os.path.isfile(path):
        return f"{name} is missing"
    if os.path.getsize(path) != expected["bytes"]:
        return f"{name} has {os.path.getsize(path)} bytes, not {expected['bytes']} (truncated?)"
    if crc32_of(path) != expected["crc32"]:
        return f"{name} fails its checksum (corrupt)"
    return None


def crc32_of(path: str) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"
