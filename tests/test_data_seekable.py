"""Resuming inside gzip and zstd files: a reader restarted at a document's seek point yields the
documents an uninterrupted read yields after it, without reading the file before that point."""

import dataclasses
import functools
import gzip
import json
import struct

import pytest

from llmstack.data import seekable
from llmstack.data.reader import plan_shards, read_shard
from llmstack.data.report import StageStats
from llmstack.data.seekable import SeekPoint

zstandard = pytest.importorskip("zstandard", reason="zstandard (the [data] extra) is not installed")


@functools.cache
def records(n=12000):
    """JSONL bytes of n documents of varied length, ids d0, d1, ..."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "über", "日本"]
    lines = []
    for i in range(n):
        text = " ".join(f"{words[i * j % 7]}{(i + j * j) % 97}" for j in range(i * 7 % 41 + 1))
        lines.append(json.dumps({"id": f"d{i}", "text": text}, ensure_ascii=False) + "\n")
    return "".join(lines).encode()


def chunks(data, size):
    return [data[i : i + size] for i in range(0, len(data), size)]


def zstd_frames(data, size, skippable=False):
    """`data` as one zstd frame per `size` bytes, with a skippable frame (as the seekable format's
    seek table) after the third when `skippable`."""
    frames = [zstandard.ZstdCompressor(level=3).compress(c) for c in chunks(data, size)]
    if skippable:
        frames.insert(3, struct.pack("<II", 0x184D2A50, 5) + b"table")
    return b"".join(frames)


LAYOUTS = {
    "gz": ("a.jsonl.gz", lambda d: gzip.compress(d, 6)),
    "gz-members": ("a.jsonl.gz", lambda d: b"".join(gzip.compress(c) for c in chunks(d, 7000)) + b"\0" * 3),
    "zst-frames": ("a.jsonl.zst", lambda d: zstd_frames(d, 6000, skippable=True)),
}


@pytest.fixture(autouse=True)
def small_spacing(monkeypatch):
    monkeypatch.setattr(seekable, "GZIP_SPACING", 4096)  # seek points every 4 KB, so small files have many


def read_all(path, start=0, seek=None):
    shard = dataclasses.replace(plan_shards([{"paths": str(path)}])[0], start=start)
    stats = StageStats()
    docs = list(read_shard(shard, stats, seek=seek))
    return docs, stats


def round_trip(point):
    return None if point is None else SeekPoint.from_dict(json.loads(json.dumps(point.to_dict())))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resume_at_any_document_reads_the_rest_exactly(tmp_path, layout):
    name, compress = LAYOUTS[layout]
    data = records()
    path = tmp_path / name
    path.write_bytes(compress(data))
    docs, stats = read_all(path)
    assert [d.id for d in docs] == [f"d{i}" for i in range(12000)] and not stats.drops
    points = {(d.seek.compressed, d.seek.uncompressed) for d in docs if d.seek is not None}
    assert len(points) > 10  # the file spans many seek points (gzip: at deflate block ends, ~150 KB here)
    for d in docs:  # a document's point is at or before its end, and not far before it
        if d.seek is not None:
            assert 0 <= d.position - d.seek.uncompressed < 2**19
    for k in [0, 1, 57, 3000, 7777, 10001, 11998, 11999]:
        resumed, stats = read_all(path, docs[k].position, round_trip(docs[k].seek))
        assert [d.id for d in resumed] == [d.id for d in docs[k + 1 :]] and not stats.drops
        assert [d.position for d in resumed] == [d.position for d in docs[k + 1 :]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resume_does_not_read_the_file_before_its_seek_point(tmp_path, layout):
    """Deep in the file, with everything before the seek point overwritten (in gzip, but the byte
    that holds the point's first bits), the resumed read is the same."""
    name, compress = LAYOUTS[layout]
    path = tmp_path / name
    path.write_bytes(compress(records()))
    docs, _ = read_all(path)
    k = 11000
    point = docs[k].seek
    assert point is not None and point.uncompressed > 10 * 2**17
    data = path.read_bytes()
    keep = point.compressed - (1 if point.bits else 0)
    path.write_bytes(b"\xff" * keep + data[keep:])
    resumed, stats = read_all(path, docs[k].position, round_trip(point))
    assert [d.id for d in resumed] == [d.id for d in docs[k + 1 :]] and not stats.drops
    damaged, stats = read_all(path)  # read from its start, the file is damaged
    assert not damaged and stats.drops == {"unreadable_file": 1}


def test_a_file_of_one_zstd_frame_resumes_from_its_start(tmp_path):
    """No seek point inside a frame: a resume decompresses from the start of the file, exactly."""
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(records()))
    docs, _ = read_all(path)
    assert all(d.seek is None for d in docs[:-1])  # (the last one's: the end of the frame, the file)
    resumed, stats = read_all(path, docs[9000].position)
    assert [d.id for d in resumed] == [d.id for d in docs[9001:]] and not stats.drops


def test_text_lines_in_gzip_resume_exactly(tmp_path):
    path = tmp_path / "a.txt.gz"
    path.write_bytes(gzip.compress(b"".join(f"line {i} {'x' * (i % 50)}\n".encode() for i in range(20000))))
    shard = plan_shards([{"paths": str(path), "text_unit": "line"}])[0]
    docs = list(read_shard(shard, StageStats()))
    k = 18000
    assert docs[k].seek is not None
    resumed = list(read_shard(dataclasses.replace(shard, start=docs[k].position), StageStats(), seek=docs[k].seek))
    assert [d.text for d in resumed] == [d.text for d in docs[k + 1 :]]


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.jsonl.zst"])
def test_a_truncated_compressed_file_keeps_what_came_before_and_is_counted(tmp_path, name):
    data = records()
    whole = gzip.compress(data) if name.endswith(".gz") else zstd_frames(data, 50000)
    path = tmp_path / name
    path.write_bytes(whole[: len(whole) // 2])
    docs, stats = read_all(path)
    assert 2000 < len(docs) < 8000 and [d.id for d in docs] == [f"d{i}" for i in range(len(docs))]
    assert stats.drops == {"unreadable_file": 1}


def test_gzip_reads_as_the_gzip_module_does(tmp_path):
    """Members, zero padding after them, an empty file; garbage after a member is an error."""
    data = records(2000)
    path = tmp_path / "a.gz"
    for whole in [gzip.compress(data), gzip.compress(data[:1000]) + gzip.compress(data[1000:]) + b"\0" * 9, b""]:
        path.write_bytes(whole)
        with seekable.open_seekable(str(path), "gzip") as f:
            assert f.read() == gzip.decompress(whole)
    path.write_bytes(gzip.compress(data) + b"junk")
    with pytest.raises(OSError), seekable.open_seekable(str(path), "gzip") as f:
        f.read()


def test_without_libz_gzip_is_read_by_the_gzip_module_and_resumes_from_the_start(tmp_path, monkeypatch):
    monkeypatch.setattr(seekable, "libz", lambda: None)
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(records()))
    docs, _ = read_all(path)
    assert len(docs) == 12000 and all(d.seek is None for d in docs)
    resumed, stats = read_all(path, docs[9000].position)
    assert [d.id for d in resumed] == [d.id for d in docs[9001:]] and not stats.drops
