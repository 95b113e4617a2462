"""The one document reader: `data clean`, `data train-tokenizer`, `data pack` and the training
stream all read documents here, so a format means the same thing everywhere.

Bad input never stops a job and is never lost silently: a malformed JSON line, invalid UTF-8, a
record without a string text field, an empty or enormous document, a file in an unknown format, a
directory that is not a saved dataset, or a file that cannot be read or decompressed is skipped
and counted by reason in the `read` stage's statistics.

Formats (a `.gz` or `.zst` suffix after any of the text formats means compressed):
- JSON lines (`.jsonl`, `.json`): one record a line, parsed here line by line rather than through
  `datasets`' JSON builder, which fails a whole file on its first malformed line; large
  uncompressed files are cut at line boundaries into shards of about `shard_bytes`;
- plain text (`.txt`): `text_unit` says what a document is: `document` (the default: the whole
  file, as a crawl or a book is stored), `paragraph` (blocks between blank lines) or `line`
  (the meanings of `datasets`' text builder's `sample_by`);
- Parquet (`.parquet`) and a directory written by `datasets.Dataset.save_to_disk`.
A UTF-8 byte-order mark at the start of a file is dropped. gzip and zstd files are decompressed by
`seekable`'s readers, which record seek points (`Document.seek`) from which a resume decompresses
instead of from the start of the file.
"""

import glob
import gzip
import io
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmstack.errors import UserError, require

from .document import Document, utf8_size
from .report import StageStats
from .seekable import SeekPoint, open_seekable, point_tracker

if TYPE_CHECKING:
    from datasets import IterableDataset

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TEXT_UNITS = ("document", "paragraph", "line")
BOM = b"\xef\xbb\xbf"


def expand_paths(paths: str | Iterable[str | Path]) -> list[str]:
    """Files named by paths and globs, in sorted order; a pattern matching nothing is an error."""
    files = []
    for pattern in [paths] if isinstance(paths, str) else paths:
        matched = sorted(glob.glob(os.path.expanduser(str(pattern)), recursive=True))
        if not matched:
            raise UserError(f"no data file matches {pattern}")
        files.extend(matched)
    return files


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
    compression: str = ""
    text_unit: str = "document"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def file_format(path: str) -> tuple[str, str]:
    """(format, compression) of a file; format "unknown" or "not_a_dataset" for what cannot be read."""
    if os.path.isdir(path):
        if Path(path, "dataset_info.json").is_file() or Path(path, "state.json").is_file():
            return "saved_dataset", ""
        return "not_a_dataset", ""
    name = Path(path).name.lower()
    stem, suffix = os.path.splitext(name)
    compression = COMPRESSIONS.get(suffix, "")
    if compression:
        suffix = os.path.splitext(stem)[1]
    for fmt, suffixes in (("jsonl", JSONL_SUFFIXES), ("text", TEXT_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if suffix in suffixes and not (compression and fmt == "parquet"):
            return fmt, compression
    return "unknown", ""


def plan_shards(inputs: Iterable[Mapping[str, Any]], shard_bytes: int = 64 * 2**20) -> list[Shard]:
    """Shards of every input ({paths, source?, text_field?, id_field?, text_unit?}), in a deterministic order."""
    shards = []
    for spec in inputs:
        if "paths" not in spec:
            raise UserError(f"every input needs `paths` (files or globs); got {spec}")
        text_unit = spec.get("text_unit", "document")
        if text_unit not in TEXT_UNITS:
            raise UserError(f"text_unit must be one of {', '.join(TEXT_UNITS)}; got {text_unit!r}")
        for path in expand_paths(spec["paths"]):
            fmt, compression = file_format(path)
            if compression == "zstd":
                _require_zstandard(path)
            common = dict(
                path=path,
                format=fmt,
                compression=compression,
                source=spec.get("source", path),
                text_field=spec.get("text_field", "text"),
                id_field=spec.get("id_field", "id"),
                text_unit=text_unit,
            )
            splittable = fmt == "jsonl" and not compression and os.access(path, os.R_OK)
            size = os.path.getsize(path) if splittable else 0
            if size > shard_bytes:
                shards += [
                    Shard(**common, start=s, end=min(s + shard_bytes, size)) for s in range(0, size, shard_bytes)
                ]
            else:
                shards.append(Shard(**common))
    return shards


def _require_zstandard(path: str) -> None:
    try:
        require("zstandard", "data")
    except UserError as e:
        raise UserError(f"{path} is zstd-compressed: {e}") from None


def iter_documents(
    paths: str | Iterable[str | Path],
    text_field: str = "text",
    text_unit: str = "document",
    stats: StageStats | None = None,
    max_doc_bytes: int = 10 * 2**20,
) -> Iterator[Document]:
    """Every readable document of the files named by `paths`, one shard per file, counting what is
    skipped in `stats` (a `StageStats`) when given."""
    stats = StageStats() if stats is None else stats
    for shard in plan_shards([{"paths": paths, "text_field": text_field, "text_unit": text_unit}], sys.maxsize):
        yield from read_shard(shard, stats, max_doc_bytes)


def read_documents(
    paths: str | Iterable[str | Path], text_field: str = "text", text_unit: str = "document", source: str | None = None
) -> "IterableDataset":
    """A `datasets.IterableDataset` of {"text"} (and {"source": source} when given) over the files
    named by `paths`, one shard per file (so `split_dataset_by_node` gives ranks whole files), read
    by this module; its `state_dict` resumes mid-file."""
    from datasets import IterableDataset

    files = expand_paths(paths)
    return IterableDataset.from_generator(
        _texts, gen_kwargs={"files": files, "text_field": text_field, "text_unit": text_unit, "source": source}
    )


def _texts(files: list[str], text_field: str, text_unit: str, source: str | None) -> Iterator[dict[str, str]]:
    tag = {} if source is None else {"source": source}
    for doc in iter_documents(files, text_field, text_unit):
        yield {"text": doc.text, **tag}


def read_shard(
    shard: Shard, stats: StageStats, max_doc_bytes: int = 10 * 2**20, seek: SeekPoint | None = None
) -> Iterator[Document]:
    """Yield the shard's documents; count every record in `stats` (docs_in/bytes_in) and every
    skipped one by reason in `stats.drops`. A file that cannot be read (or stops decompressing)
    counts as one record, after the documents read before the damage. A compressed JSONL or
    text shard that starts inside its file is decompressed from `seek` (a `Document.seek` of a
    document at or before `shard.start`) when given, else from the start of the file."""
    try:
        yield from READERS[shard.format](shard, stats, max_doc_bytes, seek)
    except _read_errors():
        _skip(stats, "unreadable_file", 0)


def _read_errors() -> tuple[type[Exception], ...]:
    errors = (OSError, EOFError)  # gzip: BadGzipFile is an OSError, a truncated file an EOFError
    try:
        import zstandard
    except ImportError:
        return errors
    return errors + (zstandard.ZstdError,)


def _open(shard: Shard, seek: SeekPoint | None = None) -> io.BufferedIOBase:
    """The file as a binary stream of its (decompressed) bytes; a compressed one opened at `seek`
    (see `llmstack.data.seekable`), where its reader records seek points as it goes."""
    if shard.compression:
        f = open_seekable(shard.path, shard.compression, seek)
        if f is not None:
            return f
        return gzip.open(shard.path, "rb")  # type: ignore[return-value]  # no libz to seek with
    return open(shard.path, "rb")


def _document(
    record: Any, shard: Shard, default_id: str, size: int, stats: StageStats, max_doc_bytes: int, position: int = -1
) -> Document | None:
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
        stats.bytes_out += utf8_size(text)
        doc_id = str(doc_id) if doc_id is not None else default_id
        return Document(text=text, id=doc_id, source=shard.source, meta=meta, position=position)
    stats.drops[reason] += 1
    return None


def _skip(stats: StageStats, reason: str, size: int) -> None:
    stats.docs_in += 1
    stats.bytes_in += size
    stats.drops[reason] += 1


def _read_jsonl(shard: Shard, stats: StageStats, max_doc_bytes: int, seek: SeekPoint | None) -> Iterator[Document]:
    seek = seek if shard.start else None
    with _open(shard, seek) as f:
        point_before = point_tracker(f)
        if seek is not None and seek.uncompressed == shard.start:
            pass  # a resume at a document's end, where the decompressor restarts: a line starts there
        elif shard.start:  # a line that began before `start` belongs to the previous shard
            f.seek(shard.start - 1)
            if f.read(1) != b"\n":
                _read_line(f, max_doc_bytes)
        for offset, line, size in _lines(f, shard.end, max_doc_bytes, stats):
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                _skip(stats, "invalid_utf8", size)
                continue
            except json.JSONDecodeError:
                _skip(stats, "malformed_json", size)
                continue
            doc = _document(record, shard, f"{shard.path}:{offset}", size, stats, max_doc_bytes, offset + size)
            if doc is not None:
                doc.seek = point_before(doc.position)
                yield doc


def _lines(
    f: io.BufferedIOBase, end: int, max_doc_bytes: int, stats: StageStats, blank: bool = False
) -> Iterator[tuple[int, bytes, int]]:
    """(offset, line, size) of the lines starting before `end` (-1: the end of the file), blank
    ones only if `blank`, without a byte-order mark; lines longer than `max_doc_bytes` are counted
    as too large."""
    offset = f.tell()  # then counted on: a tell() per line would cost a system call
    while end < 0 or offset < end:
        line, size = _read_line(f, max_doc_bytes)
        if not size:
            return
        start, offset = offset, offset + size
        if line is None:
            _skip(stats, "too_large", size)
            continue
        if start == 0 and line.startswith(BOM):
            line = line[len(BOM) :]
        if blank or line.strip():
            yield start, line, size


def _read_line(f: io.BufferedIOBase, limit: int) -> tuple[bytes | None, int]:
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


def _read_text(shard: Shard, stats: StageStats, max_doc_bytes: int, seek: SeekPoint | None) -> Iterator[Document]:
    """A whole file, its lines or its paragraphs; `shard.start` > 0 continues after the record
    that ended there (a `Document.position`), or, for a whole file, means it was read."""
    if shard.start and shard.text_unit == "document":
        return
    with _open(shard, seek if shard.start else None) as f:
        point_before = point_tracker(f)
        if shard.start:
            f.seek(shard.start)
        if shard.text_unit == "line":
            records: Iterable[tuple[int | None, bytes, int]] = _lines(f, -1, max_doc_bytes, stats)
        elif shard.text_unit == "paragraph":
            records = _paragraphs(_lines(f, -1, max_doc_bytes, stats, blank=True))
        else:
            data = f.read(max_doc_bytes + 1)
            if len(data) > max_doc_bytes:
                _skip(stats, "too_large", len(data) + sum(map(len, iter(lambda: f.read(2**20), b""))))
                return
            records = [(0, data[len(BOM) :] if data.startswith(BOM) else data, len(data))]
        for offset, data, size in records:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                _skip(stats, "invalid_utf8", size)
                continue
            default_id = shard.path if shard.text_unit == "document" else f"{shard.path}:{offset}"
            record = {shard.text_field: text.rstrip("\r\n")}
            doc = _document(record, shard, default_id, size, stats, max_doc_bytes, (offset or 0) + size)
            if doc is not None:
                doc.seek = point_before(doc.position)
                yield doc


def _paragraphs(lines: Iterable[tuple[int, bytes, int]]) -> Iterator[tuple[int | None, bytes, int]]:
    """Join consecutive lines into paragraphs: (offset of the first, bytes, size)."""
    start, parts = None, []
    for offset, line, _size in lines:
        if line.strip(b" \t\r\n"):
            start = offset if start is None else start
            parts.append(line)
            continue
        if parts:
            yield start, b"".join(parts), sum(map(len, parts))
        start, parts = None, []
    if parts:
        yield start, b"".join(parts), sum(map(len, parts))


def _read_records(
    rows: Iterable[dict[str, Any]], shard: Shard, stats: StageStats, max_doc_bytes: int, first: int = 0
) -> Iterator[Document]:
    """Records numbered from `first`."""
    for i, record in enumerate(rows, first):
        text = record.get(shard.text_field)
        size = utf8_size(text) if isinstance(text, str) else 0
        doc = _document(record, shard, f"{shard.path}:{i}", size, stats, max_doc_bytes, i + 1)
        if doc is not None:
            yield doc


def _read_parquet(shard: Shard, stats: StageStats, max_doc_bytes: int, seek: Any = None) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(shard.path)
        group, skip = 0, max(shard.start, 0)  # from row `start`: its row group, then rows within it
        while group < parquet.num_row_groups and skip >= parquet.metadata.row_group(group).num_rows:
            skip -= parquet.metadata.row_group(group).num_rows
            group += 1
        batches = parquet.iter_batches(batch_size=1024, row_groups=range(group, parquet.num_row_groups))
        rows = itertools.islice((row for batch in batches for row in batch.to_pylist()), skip, None)
        yield from _read_records(rows, shard, stats, max_doc_bytes, max(shard.start, 0))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise OSError(str(e)) from e


def _read_saved_dataset(shard: Shard, stats: StageStats, max_doc_bytes: int, seek: Any = None) -> Iterator[Document]:
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(shard.path)
    except (OSError, ValueError, FileNotFoundError) as e:
        raise OSError(str(e)) from e
    start = max(shard.start, 0)
    yield from _read_records(itertools.islice(iter(dataset), start, None), shard, stats, max_doc_bytes, start)


def _unreadable(reason: str) -> Callable[[Shard, StageStats, int, Any], Iterator[Document]]:
    def skip(shard: Shard, stats: StageStats, max_doc_bytes: int, seek: Any = None) -> Iterator[Document]:
        _skip(stats, reason, 0)
        return iter(())

    return skip


READERS = {
    "unknown": _unreadable("unknown_format"),
    "not_a_dataset": _unreadable("not_a_dataset_directory"),
    "jsonl": _read_jsonl,
    "text": _read_text,
    "parquet": _read_parquet,
    "saved_dataset": _read_saved_dataset,
}
