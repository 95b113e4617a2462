"""The quickstart corpus (Python stdlib docstrings) as token blocks, for benchmarks that train on it."""

import json
import os

import torch


def token_blocks(corpus_dir: str, tokenizer, split: str, seq_len: int) -> torch.Tensor:
    """The split's documents, EOS-joined, cut into blocks of `seq_len` + 1 tokens."""
    with open(os.path.join(corpus_dir, f"{split}.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    ids = []
    for encoding in tokenizer(texts)["input_ids"]:
        ids += encoding + [tokenizer.eos_token_id]
    n = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)
