"""The DeepSpeed internals expert parallelism relies on (llmstack.compat.deepspeed): the engine
counts llmstack's MoE blocks as MoE layers only within `counted_as_moe_layers` (as AutoEP layers
within `counted_as_autoep_layers`, for ZeRO-3), an engine that did not take them is refused, and
a ZeRO-3 checkpoint's weights outside the experts are reassembled from its shards. (The names
themselves are checked with every other internal in tests/test_compat.py; the trainer tests
tests/test_moe_ep_training.py and tests/test_moe_ep_zero3.py run the real engine.)"""

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


def test_moe_blocks_count_as_autoep_layers_within_the_block_only():
    layer_module = importlib.import_module("deepspeed.module_inject.auto_ep_layer")
    block = MoEBlock(LLMStackConfig(hidden_size=8, num_attention_heads=2, num_local_experts=2))
    assert not isinstance(block, layer_module.AutoEPMoELayer)
    with ds_compat.counted_as_autoep_layers(MoEBlock):
        assert isinstance(block, layer_module.AutoEPMoELayer)
        assert block.set_deepspeed_parallelism(False, folding_group_handles=None) is None  # groups already bound
    assert not isinstance(block, layer_module.AutoEPMoELayer) and not hasattr(block, "set_deepspeed_parallelism")


def test_marked_experts_carry_deepspeeds_moe_and_zero3_placement_markers():
    import torch

    expert = torch.nn.Parameter(torch.zeros(2))
    ds_compat.mark_expert_parameter(expert, "ep_size_2")
    assert (expert.allreduce, expert.group_name) == (False, "ep_size_2")
    assert (expert.ds_zero_placement_family, expert.ds_zero_partition_group_name) == ("autoep_expert", "ep_size_2")


def test_zero3_weights_partitioned_over_every_rank_are_reassembled_and_experts_left_out():
    import torch

    dense, norm = torch.arange(15.0).view(5, 3), torch.arange(3.0)
    model_states = {"param_shapes": [{"dense": dense.shape, "norm": norm.shape}, {"experts": torch.Size([4])}]}

    def shard(rank):  # 2 ranks: 8 of dense's 15 elements each (the last padded), 2 of norm's 3
        parts = [torch.cat([t.reshape(-1), torch.zeros(1)]).chunk(2)[rank] for t in (dense, norm)]
        groups = [
            {"families": ["replicated"], "partition_rank": rank},
            {"families": ["autoep_expert"], "partition_rank": 0},
        ]
        flats = [torch.cat(parts), torch.full((4,), float(rank))]
        return {"optimizer_state_dict": {"ds_zero_partition_groups": groups, "fp32_flat_groups": flats}}

    whole = ds_compat.zero3_replicated_state_dict(model_states, [shard(1), shard(0)])  # placed by their partition ranks
    assert set(whole) == {"dense", "norm"}
    assert torch.equal(whole["dense"], dense) and torch.equal(whole["norm"], norm)
    with pytest.raises(IncompatibleLibraryError, match="ds_zero_partition_groups"):
        ds_compat.zero3_replicated_state_dict(model_states, [{"optimizer_state_dict": {}}])
