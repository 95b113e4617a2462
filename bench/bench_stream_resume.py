"""Resuming a streaming mixture (`llmstack.data.stream.MixtureStream`) from the state a checkpoint
saves: a resume should cost the same wherever the stream stands, in the stream and inside a file.

Across a stream: the standard library's docstrings (prose, weight 0.7) and its source files (code,
0.3), each source in 8 JSONL files, read as data-parallel rank 0 of 2 with micro-batches of 8 x 256
tokens, resumed at stream position P and at 20 x P. What a position can make slower is the
readers' part of a resume: each source's reader restored at its saved place (opening its file,
seeking) and reading its next `tokenize_batch` documents. That is timed on its own (target: at
20P <= 1.5 x at P). The time to the first micro-batch is printed beside it, without a target: it
adds the tokenization of those next documents, which follows what they hold, not where they are
(the long stdlib source files after micro-batch 200 take longer to tokenize than the short ones
before). Replaying the stream from its start, what a resume costs without a saved state, grows
with the position; it is timed once each.

Within one file: a single source of `--file-mb` MB (the docstrings over and over) as JSONL, gzip
(one member, level 6, as `gzip` writes it), zstd written as a frame every `--frame-mb` MB (as
`pzstd` or the seekable format write it) and zstd as one frame (as `zstd` writes it), resumed near
its start (the state after 4 micro-batches) and at a document in its last MB (that state with the
source's place moved there: its offset, and the seek point the reader recorded before it, found by
one untimed read of the file). Target: resume at the end <= 2 x resume at the start, for every
format but zstd in one frame (printed without a target: a zstd frame cannot be entered in the
middle, so that file is decompressed up to the place). Every format's resumed micro-batch is
checked against the JSONL file's.

Times are min / median / max over `--repeats` runs; ratios compare the minima (the runs least
disturbed by other load).

    python bench/bench_stream_resume.py [--position 40] [--repeats 5] [--file-mb 200] [--frame-mb 4]
"""

import argparse
import gzip
import itertools
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from timing import run_times  # bench/timing.py

from llmstack.data.seekable import open_seekable, point_tracker
from llmstack.data.stdlib_corpus import stdlib_docstrings, stdlib_source_files
from llmstack.data.stream import MixtureStream
from llmstack.data.tokenizer import train_tokenizer

FILES_PER_SOURCE = 8
SEQ_LEN, MICRO, DP_RANK, DP_SIZE = 256, 8, 0, 2
TARGET = 1.5
FILE_TARGET = 2.0


def write_source(directory, name, texts):
    """`texts` as FILES_PER_SOURCE JSONL files `directory/name-K.jsonl`, dealt round-robin."""
    files = [open(directory / f"{name}-{k}.jsonl", "w") for k in range(FILES_PER_SOURCE)]
    for i, text in enumerate(texts):
        files[i % FILES_PER_SOURCE].write(json.dumps({"text": text}) + "\n")
    for f in files:
        f.close()
    return {"paths": str(directory / f"{name}-*.jsonl")}


def source_files():
    for path in stdlib_source_files():
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def saved_state(stream, micro_batches, dp_rank=DP_RANK, dp_size=DP_SIZE):
    """The stream's state after `micro_batches` micro-batches (what a checkpoint saves), as JSON."""
    batches = stream.micro_batches(0, MICRO, dp_rank, dp_size)
    for _ in itertools.islice(batches, micro_batches):
        pass
    return json.loads(json.dumps(stream.state_dict()))


def spread(times):
    """min / median / max."""
    return f"{times[0]:.3f} / {times[len(times) // 2]:.3f} / {times[-1]:.3f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--position", type=int, default=40, help="P, in micro-batches of this rank")
    parser.add_argument("--repeats", type=int, default=5, help="resume timings per position")
    parser.add_argument("--file-mb", type=int, default=200, help="size of the one-file source (0: skip that part)")
    parser.add_argument("--frame-mb", type=float, default=4, help="decompressed MB per frame of the zstd file")
    parser.add_argument("--skip-stream", action="store_true", help="only the one-file part")
    args = parser.parse_args()
    logging.getLogger("llmstack.data.stream").setLevel(logging.ERROR)  # the replay warning, expected here

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prose = stdlib_docstrings()
        tokenizer = train_tokenizer(prose, 8192, tmp / "tokenizer")
        if not args.skip_stream:
            ok = across_the_stream(tmp, prose, tokenizer, args.position, args.repeats)
        if args.file_mb:
            ok = within_one_file(tmp, prose, tokenizer, args.file_mb, args.frame_mb, args.repeats) and ok
    return 0 if ok else 1


def across_the_stream(tmp, prose, tokenizer, position, repeats):
    sources = [
        {**write_source(tmp, "prose", prose), "weight": 0.7},
        {**write_source(tmp, "code", source_files()), "weight": 0.3},
    ]

    def stream():
        return MixtureStream(sources, tokenizer, SEQ_LEN, seed=0)

    rows = {}
    for p in (position, 20 * position):
        state = saved_state(stream(), p)
        consumed = p * MICRO * DP_SIZE

        def resume(with_state=True, state=state, consumed=consumed):
            resumed = stream()
            if with_state:
                resumed.load_state_dict(state)
            return next(resumed.micro_batches(consumed, MICRO, DP_RANK, DP_SIZE))

        def readers(state=state):
            """Each source's reader restored at its saved place, reading its next documents (untokenized)."""
            token_lists = stream()._token_lists(DP_RANK, DP_SIZE)
            for name, part in zip(token_lists.names, token_lists.parts):
                part.encode = lambda texts: [[]] * len(texts)
                part.load_state_dict(state["dataset"]["parts"][name])
                next(iter(part))

        first = resume()
        assert (first == resume(with_state=False)).all(), "resumed and replayed streams differ"
        rows[p] = (run_times(readers, repeats), run_times(resume, repeats), run_times(lambda: resume(False), 1))

    print(f"stream position (micro-batches of {MICRO} x {SEQ_LEN} tokens, rank {DP_RANK} of {DP_SIZE}):")
    for p, (readers, resumed, replayed) in rows.items():
        print(
            f"  {p:6d}: readers' resume {spread(readers)}   first micro-batch {spread(resumed)}   "
            f"replay {replayed[0]:.2f} s"
        )
    (p1, (r1, f1, replay1)), (p20, (r20, f20, replay20)) = rows.items()
    ratio = r20[0] / r1[0]
    print(
        f"readers' resume at {p20} / at {p1}: {ratio:.2f}x (target <= {TARGET}); first micro-batch "
        f"{f20[0] / f1[0]:.2f}x (no target: tokenizing what comes next); replay {replay20[0] / replay1[0]:.1f}x"
    )
    return ratio <= TARGET


def write_files(tmp, texts, megabytes, frame_mb):
    """The one-file source as JSONL, gzip, zstd in frames and zstd in one frame: {label: path}."""
    import zstandard

    path = tmp / "big.jsonl"
    with open(path, "w") as out:
        while out.tell() < megabytes * 1e6:
            out.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    data = path.read_bytes()
    files = {"jsonl": path, "gzip": tmp / "big.jsonl.gz", "zstd frames": tmp / "frames.jsonl.zst"}
    with gzip.open(files["gzip"], "wb", compresslevel=6) as out:
        out.write(data)
    step = int(frame_mb * 1e6)
    compressor = zstandard.ZstdCompressor(level=3)
    with open(files["zstd frames"], "wb") as out:
        for i in range(0, len(data), step):
            out.write(compressor.compress(data[i : i + step]))
    files["zstd one frame"] = tmp / "one.jsonl.zst"
    files["zstd one frame"].write_bytes(compressor.compress(data))
    return files, len(data)


def late_place(path, size):
    """The source's place at the first document ending in the file's last MB: (offset, seek point),
    as the reader records them, found by reading the file's lines."""
    compression = {".gz": "gzip", ".zst": "zstd"}.get(path.suffix)
    f = open_seekable(str(path), compression) if compression else open(path, "rb")
    with f:
        point_before, offset = point_tracker(f), 0
        for line in f:
            offset += len(line)
            if offset >= size - 2**20:
                return offset, point_before(offset)
    raise ValueError(f"{path} is smaller than 1 MB")


def within_one_file(tmp, texts, tokenizer, megabytes, frame_mb, repeats):
    files, size = write_files(tmp, texts, megabytes, frame_mb)
    ok, reference = True, None
    print(f"one source of {size / 1e6:.0f} MB decompressed (zstd frames of {frame_mb:g} MB):")
    for label, path in files.items():
        sources = [{"name": "big", "paths": str(path)}]

        def stream(sources=sources):
            return MixtureStream(sources, tokenizer, SEQ_LEN, seed=0)

        early = saved_state(stream(), 4, dp_rank=0, dp_size=1)
        offset, point = late_place(path, size)
        late = json.loads(json.dumps(early))
        late["dataset"]["parts"]["big"] = {"epoch": 0, "file": 0, "position": offset}
        if point is not None:
            late["dataset"]["parts"]["big"]["seek"] = point.to_dict()

        def resume(saved, stream=stream):
            resumed = stream()
            resumed.load_state_dict(saved)
            return next(resumed.micro_batches(4 * MICRO, MICRO, 0, 1))

        batch = resume(late)
        reference = batch if reference is None else reference
        assert torch.equal(batch, reference), f"{label}: the resumed stream differs from the JSONL file's"
        at_start = run_times(lambda saved=early: resume(saved), repeats)
        at_end = run_times(lambda saved=late: resume(saved), repeats)
        ratio = at_end[0] / at_start[0]
        judged = label != "zstd one frame"
        ok = ok and (ratio <= FILE_TARGET or not judged)
        start = early["dataset"]["parts"]["big"]["position"]
        print(
            f"  {label:15s} {path.stat().st_size / 1e6:6.1f} MB: resume at byte {start:,} {spread(at_start)}, "
            f"at byte {offset:,} {spread(at_end)}: {ratio:.2f}x"
            + (f" (target <= {FILE_TARGET})" if judged else " (no target: decompressed up to the place)")
        )
    return ok


if __name__ == "__main__":
    sys.exit(main())
