"""Tokenizer training and packing through the `llmstack data` commands: the tokenizer loads with
AutoTokenizer, the .bin/.idx round-trips the documents, and PackedBlocks resumes exactly."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from llmstack.cli.main import main
from llmstack.data.blocks import PackedBlocks
from llmstack.data.indexed import IndexedDataset

TEXTS = [f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. " * (1 + i % 3) for i in range(120)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    with open(root / "docs.jsonl", "w") as f:
        for text in TEXTS:
            f.write(json.dumps({"body": text}) + "\n")
    data = ["--data", str(root / "docs.jsonl"), "--text-field", "body"]
    assert main(["data", "train-tokenizer", *data, "--vocab-size", "300", "--out", str(root / "tok")]) == 0
    assert main(["data", "pack", *data, "--tokenizer", str(root / "tok"), "--out", str(root / "train")]) == 0
    return root


def test_tokenizer_loads_with_auto_tokenizer_and_round_trips_text(packed):
    tokenizer = AutoTokenizer.from_pretrained(packed / "tok")
    assert tokenizer.eos_token == "<|endoftext|>" and len(tokenizer) <= 300
    ids = tokenizer(TEXTS[5])["input_ids"]
    assert tokenizer.decode(ids) == TEXTS[5]


def test_bin_idx_round_trips_documents_with_eos(packed):
    tokenizer = AutoTokenizer.from_pretrained(packed / "tok")
    dataset = IndexedDataset(packed / "train")
    assert len(dataset) == len(TEXTS) and dataset.dtype == np.uint16
    for i in (0, 1, 57, len(TEXTS) - 1):
        assert dataset[i].tolist() == tokenizer(TEXTS[i])["input_ids"] + [tokenizer.eos_token_id]
    assert dataset.num_tokens == sum(len(dataset[i]) for i in range(len(dataset)))


def test_packed_blocks_resume_exactly_on_another_world_size(packed):
    blocks = PackedBlocks(str(packed / "train"), seq_len=16, seed=3)

    def run(consumed, steps, dp_size, micro=2):
        per_rank = [blocks.micro_batches(consumed, micro, r, dp_size) for r in range(dp_size)]
        return [np.concatenate([next(b).numpy() for b in per_rank]) for _ in range(steps)]

    uninterrupted = run(0, 6, dp_size=2)
    resumed = run(3 * 4, 3, dp_size=4, micro=1)  # 12 samples consumed by 2 ranks, continued on 4
    assert np.array_equal(np.concatenate(uninterrupted[3:]), np.concatenate(resumed))
    step = np.concatenate(uninterrupted)
    assert len({row.tobytes() for row in step}) == len(step)  # no sample read twice
