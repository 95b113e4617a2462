"""`import llmstack` registers llmstack's model types with transformers' Auto classes, in either
import order (docs/inference.md imports transformers first) and when a stock model class is
imported after it, in a fresh interpreter."""

import subprocess
import sys

import pytest
import torch

from llmstack.data.mlm import IGNORE_INDEX as DATA_IGNORE_INDEX
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.loss import IGNORE_INDEX


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    config = LLMStackConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    torch.manual_seed(0)
    LLMStackForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "imports",
    [
        "import llmstack\nfrom transformers import AutoModelForCausalLM",
        "from transformers import AutoModelForCausalLM\nimport llmstack",
        # transformers loads its Auto models half-way through this import (modeling_layers)
        "import llmstack\nfrom transformers import LlamaForCausalLM, AutoModelForCausalLM",
    ],
    ids=["llmstack-first", "transformers-first", "llmstack-then-a-stock-model"],
)
def test_import_llmstack_registers_the_auto_classes(model_dir, imports):
    load = f"model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r})\nprint(type(model).__name__)"
    script = f"{imports}\n{load}\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["LLMStackForCausalLM"]


def test_data_labels_skip_what_the_model_losses_skip():
    assert DATA_IGNORE_INDEX == IGNORE_INDEX
