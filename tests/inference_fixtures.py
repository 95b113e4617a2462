"""Tiny models and a tiny tokenizer shared by the tests/test_inference_*.py files."""

import torch

from llmstack import LLMStackConfig, LLMStackForCausalLM
from llmstack.data.tokenizer import train_tokenizer

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Return the sum of the numbers in the list.",
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n",
] * 20


def tiny_model(seed=0, **overrides):
    """2 layers, grouped-query attention (4 query heads, 2 KV heads), in eval mode. The large init
    spreads the logits, so greedy decoding of random weights does not fall into repeating one token."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        eos_token_id=0,
        pad_token_id=1,
    )
    return LLMStackForCausalLM(LLMStackConfig(**{**fields, **overrides})).eval()


def tiny_tokenizer(out_dir):
    """Byte-level BPE of at most 320 ids (EOS 0, pad 1), saved to out_dir."""
    return train_tokenizer(TEXT, vocab_size=320, out_dir=str(out_dir))


def random_prompts(lengths, vocab=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def serve_fixtures():
    """The (tokenizer, model) module fixtures of the serve tests: in a test module,
    `tokenizer, model = serve_fixtures()`."""
    import pytest

    @pytest.fixture(scope="module")
    def tokenizer(tmp_path_factory):
        return tiny_tokenizer(tmp_path_factory.mktemp("tok"))

    @pytest.fixture(scope="module")
    def model(tokenizer):
        return tiny_model(vocab_size=len(tokenizer), max_position_embeddings=128)

    return tokenizer, model
