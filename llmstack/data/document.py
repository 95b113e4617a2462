"""The unit every cleaning stage works on, and the JSONL form it is stored in between stages."""

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Document:
    """A text with its identity: `id` is unique in the corpus, `source` names where it came from, and
    `meta` carries the input record's other fields (e.g. `url`, used by the URL blocklist)."""

    text: str
    id: str = ""
    source: str = ""
    meta: dict = field(default_factory=dict)
    # where its file's reader continues after it (not stored): a byte offset (JSONL, text lines or
    # paragraphs, the file's size for a whole-file text), or a row number (Parquet, saved datasets)
    position: int = field(default=-1, compare=False)
    # in a gzip/zstd file, the decompressor's seek point at or before `position` (a
    # `seekable.SeekPoint`; None: the start of the file), from which a resume decompresses
    seek: Any = field(default=None, compare=False, repr=False)

    def to_json(self) -> str:
        record: dict[str, object] = {"id": self.id, "source": self.source, "text": self.text}
        if self.meta:
            record["meta"] = self.meta
        return json.dumps(record, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> "Document":
        record = json.loads(line)
        return cls(text=record["text"], id=record["id"], source=record["source"], meta=record.get("meta", {}))


def utf8_size(text: str) -> int:
    """Bytes of the text in UTF-8, without encoding it when it is ASCII (a flag the string keeps)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


# A stage looks at one document, may rewrite `doc.text`, may add to `counts` (things it changed, such
# as masked e-mail addresses), and returns None to keep the document or the reason it drops it.
Stage = Callable[[Document, Counter], str | None]
