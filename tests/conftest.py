import os
import tempfile

import pytest

# Keep each test process to the cores it was given; no network for hub look-ups.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# Measured peak FLOP/s are cached per machine; tests keep theirs out of the user's ~/.cache.
os.environ.setdefault("LLMSTACK_CACHE_DIR", tempfile.mkdtemp(prefix="llmstack-test-cache-"))


@pytest.fixture
def tiny_config():
    from llmstack import LLMStackConfig

    return LLMStackConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


TINY_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A trained BPE tokenizer and packed train/valid shards of a small synthetic corpus."""
    from llmstack.data.pack import pack_documents
    from llmstack.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 30)) for i in range(600)]
    tokenizer = train_tokenizer(texts, 256, root / "tokenizer")
    pack_documents(texts[:540], tokenizer, root / "train")
    pack_documents(texts[540:], tokenizer, root / "valid")
    return {"tokenizer": str(root / "tokenizer"), "train": [str(root / "train")], "valid": [str(root / "valid")]}


def tiny_run_config(tiny_data, out_dir, **train):
    """A RunConfig dict for a 2-layer model on tiny_data; `train` overrides the schedule."""
    return {
        "model": dict(TINY_MODEL),
        "data": {**tiny_data, "seq_len": 32},
        "train": {
            "out_dir": str(out_dir),
            "micro_batch_size": 4,
            "max_steps": 6,
            "lr": 3e-3,
            "warmup_steps": 1,
            "log_interval": 1,
            "eval_interval": 100,
            "eval_samples": 16,
            "save_interval": 100,
            **train,
        },
        "monitor": {"console": False},
    }


# The head of a `python -c` script that must run without llmstack (export checks: the stock library
# alone loads what llmstack wrote): importing llmstack there fails.
WITHOUT_LLMSTACK = """
import sys


class NoLlmstack:
    def find_spec(name, *args):
        if name.split(".")[0] == "llmstack":
            raise ImportError(name)


sys.meta_path.insert(0, NoLlmstack)
"""
