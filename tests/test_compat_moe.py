"""The DeepSpeed internals expert parallelism relies on (llmstack.compat.deepspeed): the engine
counts llmstack's MoE blocks as MoE layers only within `counted_as_moe_layers`, and an engine
that did not take them is refused. (The names themselves are checked with every other internal
in tests/test_compat.py; the trainer test tests/test_moe_ep_training.py runs the real engine.)"""

import importlib
from types import SimpleNamespace

import pytest

from llmstack.compat import IncompatibleLibraryError
from llmstack.compat import deepspeed as ds_compat
from llmstack.models import LLMStackConfig
from llmstack.models.moe import MoEBlock


def test_moe_blocks_count_as_deepspeed_moe_layers_within_the_block_only():
    engine_module = importlib.import_module("deepspeed.runtime.engine")
    block = MoEBlock(LLMStackConfig(hidden_size=8, num_attention_heads=2, num_local_experts=2))
    assert not isinstance(block, engine_module.MoE)
    with ds_compat.counted_as_moe_layers(MoEBlock):
        assert isinstance(block, engine_module.MoE)
    assert not isinstance(block, engine_module.MoE)


def test_moe_param_groups_put_marked_experts_in_groups_of_their_own():
    import torch

    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    groups = ds_compat.moe_param_groups([{"name": "decay", "params": [dense, expert], "weight_decay": 0.1}])
    assert [(g["name"], g.get("moe", False), g["params"], g["weight_decay"]) for g in groups] == [
        ("decay", False, [dense], 0.1),
        ("ep_size_2", True, [expert], 0.1),
    ]


@pytest.mark.parametrize("has_moe_layers", [False, None])
def test_an_engine_that_did_not_take_the_moe_blocks_is_refused(has_moe_layers):
    engine = SimpleNamespace(optimizer=object())
    if has_moe_layers is not None:
        engine.has_moe_layers = has_moe_layers
    with pytest.raises(IncompatibleLibraryError, match="has_moe_layers"):
        ds_compat.check_moe_engine(engine)
    ds_compat.check_moe_engine(SimpleNamespace(optimizer=object(), has_moe_layers=True))
