"""Resuming a streaming mixture (`llmstack.data.stream.MixtureStream`) from the state a checkpoint
saves, at stream position P and at 20 x P: the time to the first micro-batch should not grow with
the position. Replaying the stream from its start, which is what a resume cost before the state
was saved (and what a checkpoint without it still costs), grows with the position; it is timed
beside it.

Corpus: the standard library's docstrings (prose, weight 0.7) and its source files (code, 0.3),
each source in 8 JSONL files, read as data-parallel rank 0 of 2 with micro-batches of 8 x 256
tokens. Target: resume at 20P <= 1.5 x resume at P.

    python bench/bench_stream_resume.py [--position 40] [--repeats 3]
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


def saved_state(stream, micro_batches):
    """The stream's state after `micro_batches` micro-batches (what a checkpoint saves), as JSON."""
    batches = stream.micro_batches(0, MICRO, DP_RANK, DP_SIZE)
    for _ in itertools.islice(batches, micro_batches):
        pass
    return json.loads(json.dumps(stream.state_dict()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--position", type=int, default=40, help="P, in micro-batches of this rank")
    parser.add_argument("--repeats", type=int, default=3, help="resume timings per position (the best is kept)")
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

    print(f"stream position (micro-batches of {MICRO} x {SEQ_LEN} tokens, rank {DP_RANK} of {DP_SIZE}):")
    for position, (resumed, replayed) in rows.items():
        print(f"  {position:6d}: resume from saved state {resumed:7.3f} s   replay from the start {replayed:7.2f} s")
    (p1, (r1, p_1)), (p20, (r20, p_20)) = rows.items()
    ratio = r20 / r1
    print(f"resume time at {p20} / at {p1}: {ratio:.2f}x (target <= {TARGET}; replay: {p_20 / p_1:.1f}x)")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
