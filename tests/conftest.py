import os

import pytest

# Keep each test process to the cores it was given; no network for hub look-ups.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture
def tiny_config():
    from llmstack import LLMStackConfig

    return LLMStackConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
