"""The quickstart corpus (Python stdlib docstrings) as token blocks, for benchmarks that train on it."""

import json
import os
import tempfile

import torch

from llmstack.data.stdlib_corpus import write_stdlib_corpus
from llmstack.data.tokenizer import train_tokenizer


def stdlib_blocks(vocab_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, valid) blocks of `seq_len` + 1 tokens of the stdlib corpus, under a BPE tokenizer of
    `vocab_size` trained on its train split."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus")
        write_stdlib_corpus(corpus)
        with open(os.path.join(corpus, "train.jsonl")) as f:
            tokenizer = train_tokenizer((json.loads(line)["text"] for line in f), vocab_size, os.path.join(tmp, "tok"))
        return tuple(token_blocks(corpus, tokenizer, split, seq_len) for split in ("train", "valid"))  # type: ignore[return-value]


def token_blocks(corpus_dir: str, tokenizer, split: str, seq_len: int) -> torch.Tensor:
    """The split's documents, EOS-joined, cut into blocks of `seq_len` + 1 tokens."""
    with open(os.path.join(corpus_dir, f"{split}.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    ids = []
    for encoding in tokenizer(texts)["input_ids"]:
        ids += encoding + [tokenizer.eos_token_id]
    n = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)
