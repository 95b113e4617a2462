"""Tokenizer training and packing through the `llmstack data` commands: the tokenizer loads with
AutoTokenizer, the .bin/.idx round-trips the documents, packing in worker processes matches packing
in one, a rerun keeps finished shards, and PackedBlocks resumes exactly."""

import json
import os
import shlex

import numpy as np
import pytest
from transformers import AutoTokenizer

from llmstack.cli.main import main
from llmstack.data.blocks import PackedBlocks
from llmstack.data.indexed import IndexedDataset
from llmstack.data.pack import pack_documents, pack_files
from llmstack.data.tokenizer import load_tokenizer
from llmstack.training.config import apply_override

TEXTS = [f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. " * (1 + i % 3) for i in range(120)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    write_jsonl(root / "docs.jsonl", TEXTS)
    data = ["--data", str(root / "docs.jsonl"), "--text-field", "body"]
    assert main(["data", "train-tokenizer", *data, "--vocab-size", "300", "--out", str(root / "tok")]) == 0
    assert main(["data", "pack", *data, "--tokenizer", str(root / "tok"), "--out", str(root / "train")]) == 0
    return root


def write_jsonl(path, texts):
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"body": text}) + "\n")


def test_tokenizer_loads_with_auto_tokenizer_and_round_trips_text(packed):
    tokenizer = AutoTokenizer.from_pretrained(packed / "tok")
    assert tokenizer.eos_token == "<|endoftext|>" and len(tokenizer) <= 300
    ids = tokenizer(TEXTS[5])["input_ids"]
    assert tokenizer.decode(ids) == TEXTS[5]


def test_bin_idx_round_trips_documents_with_eos(packed):
    tokenizer = AutoTokenizer.from_pretrained(packed / "tok")
    dataset = IndexedDataset(packed / "train-00000")
    assert len(dataset) == len(TEXTS) and dataset.dtype == np.uint16
    for i in (0, 1, 57, len(TEXTS) - 1):
        assert dataset[i].tolist() == tokenizer(TEXTS[i])["input_ids"] + [tokenizer.eos_token_id]
    assert dataset.num_tokens == sum(len(dataset[i]) for i in range(len(dataset)))


def test_packed_blocks_resume_exactly_on_another_world_size(packed):
    blocks = PackedBlocks(str(packed / "train-00000"), seq_len=16, seed=3)

    def run(consumed, steps, dp_size, micro=2):
        per_rank = [blocks.micro_batches(consumed, micro, r, dp_size) for r in range(dp_size)]
        return [np.concatenate([next(b).numpy() for b in per_rank]) for _ in range(steps)]

    uninterrupted = run(0, 6, dp_size=2)
    resumed = run(3 * 4, 3, dp_size=4, micro=1)  # 12 samples consumed by 2 ranks, continued on 4
    assert np.array_equal(np.concatenate(uninterrupted[3:]), np.concatenate(resumed))
    step = np.concatenate(uninterrupted)
    assert len({row.tobytes() for row in step}) == len(step)  # no sample read twice


def test_pack_in_workers_matches_one_process_and_rerun_keeps_finished_shards(packed, tmp_path, capsys):
    parts = [TEXTS[:50], TEXTS[50:51], TEXTS[51:]]
    for i, part in enumerate(parts):
        write_jsonl(tmp_path / f"part{i}.jsonl", part)
    tok = str(packed / "tok")
    args = ["data", "pack", "--data", str(tmp_path / "part*.jsonl"), "--text-field", "body", "--tokenizer", tok]
    assert main([*args, "--out", str(tmp_path / "train"), "--workers", "2"]) == 0
    raw = {"data": {}}
    apply_override(raw, shlex.split(capsys.readouterr().out.splitlines()[-1])[0])  # the printed override
    shards = raw["data"]["train"]
    assert shards == [str(tmp_path / f"train-{i:05d}") for i in range(3)]

    pack_documents(TEXTS, load_tokenizer(tok), tmp_path / "whole")
    whole = IndexedDataset(tmp_path / "whole")
    docs = [IndexedDataset(s)[i].tolist() for s in shards for i in range(len(IndexedDataset(s)))]
    assert [len(IndexedDataset(s)) for s in shards] == [len(p) for p in parts]
    assert docs == [whole[i].tolist() for i in range(len(whole))]

    files = [f"{s}{ext}" for s in shards for ext in (".bin", ".idx")]
    mtimes = {f: os.stat(f).st_mtime_ns for f in files}
    for ext in (".bin", ".idx"):  # as if the job was killed before the last shard was complete
        os.remove(shards[2] + ext)
    assert pack_files(str(tmp_path / "part*.jsonl"), tok, tmp_path / "train", "body", workers=2) == (
        shards,
        len(TEXTS),
        whole.num_tokens,
    )
    assert {f: os.stat(f).st_mtime_ns for f in files[:4]} == {f: mtimes[f] for f in files[:4]}
    assert IndexedDataset(shards[2])[0].tolist() == whole[51].tolist()


def test_a_tokenizer_without_a_rust_backend_packs_the_same_ids(packed, tmp_path):
    """Slow (Python) tokenizers have no backend_tokenizer; packing goes through their call instead."""
    fast = load_tokenizer(str(packed / "tok"))

    class SlowTokenizer:
        is_fast = False
        eos_token_id = fast.eos_token_id

        def __len__(self) -> int:
            return len(fast)

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [fast.encode(t, add_special_tokens=add_special_tokens) for t in texts]}

    pack_documents(TEXTS, fast, tmp_path / "fast")
    pack_documents(TEXTS, SlowTokenizer(), tmp_path / "slow")
    assert (tmp_path / "fast.bin").read_bytes() == (tmp_path / "slow.bin").read_bytes()
