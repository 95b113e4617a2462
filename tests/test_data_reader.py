"""The one reader: compressed JSONL and text, byte-order marks, what a .txt document is, and
files it cannot read counted by reason while the job goes on; pack and the stream read the same."""

import gzip
import json

import pytest

from llmstack.data.pack import pack_files
from llmstack.data.pipeline import run_pipeline
from llmstack.data.reader import iter_documents, read_documents
from llmstack.data.report import StageStats
from llmstack.data.tokenizer import train_tokenizer
from llmstack.errors import UserError

RECORDS = [{"text": f"document number {i}", "id": f"d{i}"} for i in range(3)]


def jsonl_bytes(records):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def read(paths, **options):
    stats = StageStats()
    return [d.text for d in iter_documents(paths, stats=stats, **options)], stats


def zstd_compress(data):
    zstandard = pytest.importorskip("zstandard", reason="zstandard (the [data] extra) is not installed")
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize(
    "name, compress", [("a.jsonl", bytes), ("a.jsonl.gz", gzip.compress), ("a.json.zst", zstd_compress)]
)
def test_jsonl_plain_gzip_and_zstd_read_the_same(tmp_path, name, compress):
    (tmp_path / name).write_bytes(compress(b"\xef\xbb\xbf" + jsonl_bytes(RECORDS)))  # with a byte-order mark
    texts, stats = read(str(tmp_path / name))
    assert texts == [r["text"] for r in RECORDS] and not stats.drops


@pytest.mark.parametrize(
    "unit, expected",
    [
        ("document", ["first line\nsecond line\n\nnext paragraph"]),
        ("paragraph", ["first line\nsecond line", "next paragraph"]),
        ("line", ["first line", "second line", "next paragraph"]),
    ],
)
def test_text_unit_says_what_a_txt_document_is(tmp_path, unit, expected):
    data = "\ufefffirst line\nsecond line\n\nnext paragraph\n".encode()
    (tmp_path / "a.txt").write_bytes(data)
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(data))
    texts, _ = read([str(tmp_path / "a.txt"), str(tmp_path / "b.txt.gz")], text_unit=unit)
    assert texts == expected * 2


def test_unreadable_and_unknown_files_are_counted_and_the_rest_is_read(tmp_path):
    good = gzip.compress(jsonl_bytes(RECORDS * 200))
    (tmp_path / "a.jsonl.gz").write_bytes(good)
    (tmp_path / "b.jsonl.gz").write_bytes(good[: len(good) // 2])  # truncated: what came before is kept
    (tmp_path / "c.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "d.csv").write_text("text\nx\n")
    (tmp_path / "e").mkdir()
    texts, stats = read(str(tmp_path / "*"))
    assert stats.drops == {"unreadable_file": 2, "unknown_format": 1, "not_a_dataset_directory": 1}
    assert 600 < len(texts) < 1200 and texts[:600] == [r["text"] for r in RECORDS * 200]


def test_bad_text_unit_is_a_user_error(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(UserError, match="text_unit"):
        read(str(tmp_path / "a.txt"), text_unit="sentence")


def test_clean_pack_and_stream_read_compressed_files(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(RECORDS)))
    (tmp_path / "in" / "notes.md").write_text("# not data")
    paths = str(tmp_path / "in" / "*")
    stats = run_pipeline({"inputs": [{"paths": [paths]}], "output": str(tmp_path / "out")}, show=lambda _: None)
    assert stats["read"].docs_out == 3 and stats["read"].drops == {"unknown_format": 1}
    assert [row["text"] for row in read_documents(paths)] == [r["text"] for r in RECORDS]
    tokenizer = train_tokenizer((r["text"] for r in RECORDS * 10), 300, tmp_path / "tok")
    _, docs, tokens = pack_files([str(tmp_path / "in" / "a.jsonl.gz")], tmp_path / "tok", tmp_path / "packed")
    assert docs == 3 and tokens == sum(len(tokenizer(r["text"])["input_ids"]) + 1 for r in RECORDS)
