"""Tokenize + pack throughput (`llmstack.data.pack.pack_documents`: encode, append EOS, write the
.bin/.idx) against raw `tokenizers` `encode_batch` on the same texts, side by side in one run.
Target: >= 0.8x.

    python bench/bench_tokenize.py
"""

import sys
import tempfile
from pathlib import Path

from timing import best_time  # bench/timing.py

from llmstack.data.pack import pack_documents
from llmstack.data.stdlib_corpus import stdlib_docstrings
from llmstack.data.tokenizer import train_tokenizer

BATCH = 512  # pack_documents' default batch


def main():
    docs = stdlib_docstrings()
    megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(docs, 8192, Path(tmp, "tokenizer"))
        backend = tokenizer.backend_tokenizer

        def raw():
            for start in range(0, len(docs), BATCH):
                backend.encode_batch(docs[start : start + BATCH], add_special_tokens=False)

        def pack():
            pack_documents(docs, tokenizer, Path(tmp, "packed"), batch_size=BATCH)

        raw_time, pack_time = best_time(raw), best_time(pack)
    print(f"corpus: {len(docs)} stdlib docstrings, {megabytes:.2f} MB, 8k byte-level BPE")
    print(f"tokenizers encode_batch   : {megabytes / raw_time:6.2f} MB/s")
    print(f"llmstack pack_documents   : {megabytes / pack_time:6.2f} MB/s")
    ratio = raw_time / pack_time
    print(f"pack / encode_batch: {ratio:.2f}x (target >= 0.8x)")
    print("PASS" if ratio >= 0.8 else "FAIL")
    return 0 if ratio >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
