"""Reading raw documents robustly, in shards that worker processes can read independently.

Bad input never stops a job and is never lost silently: a malformed JSON line, invalid UTF-8, a
record without a string text field, an empty or enormous document, or a file that cannot be read
is skipped and counted by reason in the `read` stage's statistics.

Formats: JSON lines (`.jsonl`, `.json`), plain text (`.txt`, one file is one document), Parquet,
and a directory written by `datasets.Dataset.save_to_disk`. JSON lines are parsed here line by
line rather than through `datasets`' JSON builder, which fails a whole file on its first
malformed line; large JSONL files are cut at line boundaries into shards of about `shard_bytes`.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from llmstack.errors import UserError

from .document import Document
from .pack import expand_paths

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Shard:
    """A unit of work: the lines starting in bytes [start, end) of a JSONL file, or a whole file."""

    path: str
    format: str
    source: str
    text_field: str = "text"
    id_field: str = "id"
    start: int = 0
    end: int = -1

    def to_dict(self):
        return asdict(self)


def file_format(path):
    if os.path.isdir(path):
        if Path(path, "dataset_info.json").is_file() or Path(path, "state.json").is_file():
            return "saved_dataset"
        raise UserError(f"{path} is a directory but not a dataset saved with `save_to_disk`; give files or globs")
    suffix = Path(path).suffix.lower()
    for fmt, suffixes in (("jsonl", JSONL_SUFFIXES), ("text", TEXT_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if suffix in suffixes:
            return fmt
    raise UserError(f"{path}: unknown data format {suffix!r}; use .jsonl, .json, .txt, .parquet or a saved dataset")


def plan_shards(inputs, shard_bytes=64 * 2**20):
    """Shards of every input ({paths, source?, text_field?, id_field?}), in a deterministic order."""
    shards = []
    for spec in inputs:
        if "paths" not in spec:
            raise UserError(f"every input needs `paths` (files or globs); got {spec}")
        for path in expand_paths(spec["paths"]):
            common = dict(path=path, format=file_format(path), source=spec.get("source", path),
                          text_field=spec.get("text_field", "text"), id_field=spec.get("id_field", "id"))
            size = os.path.getsize(path) if common["format"] == "jsonl" and os.access(path, os.R_OK) else 0
            if size > shard_bytes:
                shards += [Shard(**common, start=s, end=min(s + shard_bytes, size))
                           for s in range(0, size, shard_bytes)]
            else:
                shards.append(Shard(**common))
    return shards


def read_shard(shard, stats, max_doc_bytes=10 * 2**20):
    """Yield the shard's documents; count every record in `stats` (docs_in/bytes_in) and every
    skipped one by reason in `stats.drops`. A file that cannot be read counts as one record."""
    try:
        yield from READERS[shard.format](shard, stats, max_doc_bytes)
    except OSError:
        _skip(stats, "unreadable_file", 0)


def _document(record, shard, default_id, size, stats, max_doc_bytes):
    """The Document of one parsed record, or None (counted) when it must be skipped."""
    stats.docs_in += 1
    stats.bytes_in += size
    text = record.get(shard.text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        reason = "missing_text" if isinstance(record, dict) else "malformed_record"
    elif not text.strip():
        reason = "empty"
    elif size > max_doc_bytes:
        reason = "too_large"
    else:
        meta = {k: v for k, v in record.items() if k not in (shard.text_field, shard.id_field)}
        doc_id = record.get(shard.id_field)
        stats.docs_out += 1
        stats.bytes_out += len(text.encode("utf-8"))
        return Document(text=text, id=str(doc_id) if doc_id is not None else default_id, source=shard.source, meta=meta)
    stats.drops[reason] += 1
    return None


def _skip(stats, reason, size):
    stats.docs_in += 1
    stats.bytes_in += size
    stats.drops[reason] += 1


def _read_jsonl(shard, stats, max_doc_bytes):
    with open(shard.path, "rb") as f:
        end = shard.end if shard.end >= 0 else os.fstat(f.fileno()).st_size
        if shard.start:  # a line that began before `start` belongs to the previous shard
            f.seek(shard.start - 1)
            if f.read(1) != b"\n":
                _read_line(f, max_doc_bytes)
        while (offset := f.tell()) < end:
            line, size = _read_line(f, max_doc_bytes)
            if line is None:
                _skip(stats, "too_large", size)
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                _skip(stats, "invalid_utf8", size)
                continue
            except json.JSONDecodeError:
                _skip(stats, "malformed_json", size)
                continue
            doc = _document(record, shard, f"{shard.path}:{offset}", size, stats, max_doc_bytes)
            if doc is not None:
                yield doc


def _read_line(f, limit):
    """(line, size), or (None, size) for a line longer than `limit`, which is skipped without ever
    being held in memory whole."""
    line = f.readline(limit + 1)
    if len(line) <= limit or line.endswith(b"\n"):
        return line, len(line)
    size = len(line)
    while chunk := f.readline(2**20):
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return None, size


def _read_text(shard, stats, max_doc_bytes):
    size = os.path.getsize(shard.path)
    if size > max_doc_bytes:
        _skip(stats, "too_large", size)
        return
    with open(shard.path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        _skip(stats, "invalid_utf8", size)
        return
    doc = _document({shard.text_field: text}, shard, shard.path, size, stats, max_doc_bytes)
    if doc is not None:
        yield doc


def _read_records(rows, shard, stats, max_doc_bytes):
    for i, record in enumerate(rows):
        text = record.get(shard.text_field)
        size = len(text.encode("utf-8")) if isinstance(text, str) else 0
        doc = _document(record, shard, f"{shard.path}:{i}", size, stats, max_doc_bytes)
        if doc is not None:
            yield doc


def _read_parquet(shard, stats, max_doc_bytes):
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(shard.path).iter_batches(batch_size=1024)
        rows = (row for batch in batches for row in batch.to_pylist())
        yield from _read_records(rows, shard, stats, max_doc_bytes)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise OSError(str(e)) from e


def _read_saved_dataset(shard, stats, max_doc_bytes):
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(shard.path)
    except (OSError, ValueError, FileNotFoundError) as e:
        raise OSError(str(e)) from e
    yield from _read_records(iter(dataset), shard, stats, max_doc_bytes)


READERS = {"jsonl": _read_jsonl, "text": _read_text, "parquet": _read_parquet, "saved_dataset": _read_saved_dataset}
