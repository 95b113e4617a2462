"""train.expert_parallel_size is refused, before the engine starts, where it cannot apply: a dense
model, a size that does not divide the experts, and (the layout table) tensor parallelism at ZeRO-3, OneBitAdam and
fp32 ZeRO-0 clipping (whose norm would miss other ranks' experts). The data-parallel size is checked by Topology
(tests/test_moe_ep_training.py)."""

import pytest
from conftest import tiny_run_config

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig
from llmstack.parallel.layout import check_layout
from llmstack.training.config import parse_run_config, run_layout
from llmstack.training.expert_parallel import check_expert_count

MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    "model, size, message",
    [
        ({}, 2, "must divide model.num_local_experts (0)"),
        (MOE, 3, "must divide model.num_local_experts (4)"),
        (MOE, 0, "must be at least 1"),
    ],
)
def test_run_config_refuses_expert_parallelism_without_experts_to_split(tmp_path, model, size, message):
    raw = tiny_run_config({"tokenizer": "tok", "train": ["data"]}, tmp_path, expert_parallel_size=size)
    raw["model"].update(model)
    with pytest.raises(UserError, match="train.expert_parallel_size") as refused:
        parse_run_config(raw)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "ds_config, grad_clip, message",
    [
        ({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 3}}, 0.0, "1-bit Adam with ZeRO stage 3"),
        ({"zero_optimization": {"stage": 0}}, 1.0, "train.grad_clip=0"),
    ],
)
def test_engine_settings_expert_parallelism_does_not_support_are_refused(tmp_path, ds_config, grad_clip, message):
    raw = tiny_run_config(
        {"tokenizer": "tok", "train": ["data"]}, tmp_path, expert_parallel_size=2, grad_clip=grad_clip
    )
    raw["model"].update(MOE)
    run = parse_run_config(raw)
    with pytest.raises(UserError, match=message):
        check_layout(run_layout(run, ds_config))
    for supported in [
        {"zero_optimization": {"stage": 2}},
        {"zero_optimization": {"stage": 3}},
        {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}},
        {"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 2}},
    ]:
        check_layout(run_layout(run, supported))


def test_tensor_and_expert_parallelism_at_zero3_are_refused(tmp_path):
    """DeepSpeed's ZeRO-3 norm would miss the other tensor-parallel ranks' experts (README)."""
    raw = tiny_run_config(
        {"tokenizer": "tok", "train": ["data"]}, tmp_path, expert_parallel_size=2, tensor_parallel_size=2
    )
    raw["model"].update(MOE)
    run = parse_run_config(raw)
    with pytest.raises(UserError, match="expert and tensor parallelism with ZeRO stage 3"):
        check_layout(run_layout(run, {"zero_optimization": {"stage": 3}}))
    check_layout(run_layout(run, {"zero_optimization": {"stage": 2}}))


def test_a_pretrained_model_s_experts_are_checked_once_its_config_is_read():
    check_expert_count(2, LLMStackConfig(hidden_size=8, num_attention_heads=2, **MOE))
    with pytest.raises(UserError, match=r"must divide the model's num_local_experts \(0\)"):
        check_expert_count(2, LLMStackConfig(hidden_size=8, num_attention_heads=2))
