"""Mixtral interchange, checked like the dense families (tests/test_interop_families.py): a small
random stock MixtralForCausalLM is imported (same logits), trained one step, exported with
`llmstack export-hf --format mixtral` and reloaded by the stock class in a process that never
imports llmstack (same logits). What Mixtral cannot express is refused by name."""

import pytest
from test_interop_families import BASE, check_round_trip, random_stock_model
from transformers import MixtralConfig, MixtralForCausalLM

from llmstack.models import LLMStackConfig, to_hf_config

MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def test_mixtral_round_trip_with_sliding_window(tmp_path):
    stock = {
        "mixtral": random_stock_model(MixtralForCausalLM, MixtralConfig(**BASE, **MOE)),
        "mixtral-top1-window": random_stock_model(
            MixtralForCausalLM, MixtralConfig(**BASE, num_local_experts=3, num_experts_per_tok=1, sliding_window=8)
        ),
    }
    check_round_trip(tmp_path, "mixtral", "MixtralForCausalLM", stock)


@pytest.mark.parametrize(
    "family, fields, named",
    [
        ("mixtral", {}, "num_local_experts"),
        ("llama", MOE, "num_local_experts"),
        ("mixtral", {**MOE, "moe_shared_intermediate_size": 16}, "shared experts"),
        ("mixtral", {**MOE, "moe_layers": [1]}, "moe_layers"),
        ("mixtral", {**MOE, "moe_norm_topk_prob": False}, "moe_norm_topk_prob"),
    ],
)
def test_export_refuses_what_mixtral_cannot_express(family, fields, named):
    with pytest.raises(ValueError, match=named):
        to_hf_config(LLMStackConfig(**BASE, **fields), family)
