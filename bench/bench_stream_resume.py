"""Resuming a streaming mixture (`llmstack.data.stream.MixtureStream`) from the state a checkpoint
saves, at stream position P and at 20 x P: the time to the first micro-batch should not grow with
the position. Replaying the stream from its start, which is what a resume cost before the state
was saved (and what a checkpoint without it still costs), grows with the position; it is timed
beside it.

Corpus: the standard library's docstrings (prose, weight 0.7) and its source files (code, 0.3),
each source in 8 JSONL files, read as data-parallel rank 0 of 2 with micro-batches of 8 x 256
tokens. Target: resume at 20P <= 1.5 x resume at P.

Within one file: a single JSONL source of `--file-mb` MB (the docstrings over and over), resumed
near its start and in its last MB (the state saved near the start with the reader's byte offset
moved to a line boundary in the last MB: the stream continues from there). Target: resume at the
end <= 2 x resume at the start (a reader that re-reads its file up to its place grows with it).

    python bench/bench_stream_resume.py [--position 40] [--repeats 3] [--file-mb 200]
"""

import argparse
import itertools
import json
import logging
import sys
import tempfile
from pathlib import Path

from timing import best_time  # bench/timing.py

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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--position", type=int, default=40, help="P, in micro-batches of this rank")
    parser.add_argument("--repeats", type=int, default=3, help="resume timings per position (the best is kept)")
    parser.add_argument("--file-mb", type=int, default=200, help="size of the one-file source (0: skip that part)")
    args = parser.parse_args()
    logging.getLogger("llmstack.data.stream").setLevel(logging.ERROR)  # the replay warning, expected here

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prose = stdlib_docstrings()
        tokenizer = train_tokenizer(prose, 8192, tmp / "tokenizer")
        sources = [
            {**write_source(tmp, "prose", prose), "weight": 0.7},
            {**write_source(tmp, "code", source_files()), "weight": 0.3},
        ]

        def stream():
            return MixtureStream(sources, tokenizer, SEQ_LEN, seed=0)

        rows = {}
        for position in (args.position, 20 * args.position):
            state = saved_state(stream(), position)
            consumed = position * MICRO * DP_SIZE

            def resume(with_state=True, state=state, consumed=consumed):
                resumed = stream()
                if with_state:
                    resumed.load_state_dict(state)
                return next(resumed.micro_batches(consumed, MICRO, DP_RANK, DP_SIZE))

            first = resume()
            assert (first == resume(with_state=False)).all(), "resumed and replayed streams differ"
            rows[position] = (best_time(resume, args.repeats), best_time(lambda: resume(with_state=False), 1))
        in_file = within_one_file(tmp, prose, tokenizer, args.file_mb, args.repeats) if args.file_mb else None

    print(f"stream position (micro-batches of {MICRO} x {SEQ_LEN} tokens, rank {DP_RANK} of {DP_SIZE}):")
    for position, (resumed, replayed) in rows.items():
        print(f"  {position:6d}: resume from saved state {resumed:7.3f} s   replay from the start {replayed:7.2f} s")
    (p1, (r1, p_1)), (p20, (r20, p_20)) = rows.items()
    ratio = r20 / r1
    print(f"resume time at {p20} / at {p1}: {ratio:.2f}x (target <= {TARGET}; replay: {p_20 / p_1:.1f}x)")
    ok = ratio <= TARGET
    if in_file is not None:
        size, start, at_start, at_end = in_file
        file_ratio = at_end / at_start
        print(
            f"one {size / 1e6:.0f} MB JSONL file: resume at byte {start:,} {at_start:.3f} s, in its last MB "
            f"{at_end:.3f} s: {file_ratio:.2f}x (target <= {FILE_TARGET})"
        )
        ok = ok and file_ratio <= FILE_TARGET
    return 0 if ok else 1


def within_one_file(tmp, texts, tokenizer, megabytes, repeats):
    """(file bytes, the saved byte offset, resume time there, resume time in the last MB)."""
    path = tmp / "big.jsonl"
    with open(path, "w") as out:
        while out.tell() < megabytes * 1e6:
            out.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    size = path.stat().st_size
    with open(path, "rb") as f:  # a line boundary in the last MB
        f.seek(size - 2**20)
        f.readline()
        late = f.tell()
    sources = [{"name": "big", "paths": str(path)}]

    def stream():
        return MixtureStream(sources, tokenizer, SEQ_LEN, seed=0)

    state = saved_state(stream(), 4, dp_rank=0, dp_size=1)
    moved = json.loads(json.dumps(state))
    moved["dataset"]["parts"]["big"]["position"] = late

    def resume(saved):
        resumed = stream()
        resumed.load_state_dict(saved)
        return next(resumed.micro_batches(4 * MICRO, MICRO, 0, 1))

    start = state["dataset"]["parts"]["big"]["position"]
    return size, start, best_time(lambda: resume(state), repeats), best_time(lambda: resume(moved), repeats)


if __name__ == "__main__":
    sys.exit(main())
