"""ZeRO stages 0-3 with and without offload on 2 ranks (gloo): per-rank memory of parameters,
gradients, master weights and optimizer state, and equal training losses."""

import json
from pathlib import Path

import deepspeed
import pytest
import torch

from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.testing import run_distributed
from llmstack.training.memory import ByteCounter, zero_memory_report

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
OFFLOAD_OPTIMIZER = {"offload_optimizer": {"device": "cpu"}}
# name -> (ds_configs file or None for plain ZeRO-0, extra zero_optimization keys)
SETUPS = {
    "zero0": (None, {}),
    "zero1": ("zero1", {}),
    "zero1_offload": ("zero1", OFFLOAD_OPTIMIZER),
    "zero2": ("zero2", {}),
    "zero2_offload": ("zero2_offload", {}),
    "zero3": ("zero3", {}),
    "zero3_offload": ("zero3_offload", {}),
    "zero3_param_offload": ("zero3_param_offload", {}),
}
STEPS = 5


def ds_config(name):
    file, zero_extra = SETUPS[name]
    config = json.loads((DS_CONFIGS / f"{file}.json").read_text()) if file else {"zero_optimization": {"stage": 0}}
    config["zero_optimization"].update(zero_extra, stage3_param_persistence_threshold=0)  # partition every tensor
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=0.0)
    # torch's AdamW everywhere: the same arithmetic at every stage, and no CPU-Adam build in the tests.
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
    return config


def batch(rank, step):
    """Counting sequences (the next token is the current one + 1): learnable in a few steps."""
    starts = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(100 * step + rank))
    return (starts + torch.arange(16)) % 128


def train_and_measure(name, rank):
    """Losses of STEPS steps, the loss after them, and the memory report taken between the
    second backward and step (gradients live, optimizer state created by the first step)."""
    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2
    )
    model = LLMStackForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(name))
    losses, report = [], None
    for step in range(STEPS):
        loss = engine(input_ids=batch(rank, step), labels=batch(rank, step)).loss
        engine.backward(loss)
        if step == 1:
            report = zero_memory_report(engine)
        engine.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = engine(input_ids=batch(rank, STEPS), labels=batch(rank, STEPS)).loss.item()
    return {"losses": losses, "final": final, "memory": report}


def check_all(rank, world_size):
    return {name: train_and_measure(name, rank) for name in SETUPS}


@pytest.fixture(scope="module")
def results():
    return run_distributed(check_all, world_size=2)


def ratio(results, name, kind):
    return [r[name]["memory"][kind] / r["zero0"]["memory"][kind] for r in results]


@pytest.mark.parametrize("name", [n for n in SETUPS if n != "zero0"])
def test_optimizer_state_per_rank_is_half_of_zero0(results, name):
    for value in ratio(results, name, "optimizer_state"):
        assert value == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero3_param_offload"])
def test_zero3_parameters_per_rank_are_half(results, name):
    for value in ratio(results, name, "parameters"):
        assert value == pytest.approx(0.5, rel=0.05)


def test_zero0_fp32_memory_is_the_model_and_two_moments(results):
    numel = sum(
        p.numel()
        for p in LLMStackForCausalLM(
            LLMStackConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2
            )
        ).parameters()
    )
    for r in results:
        memory = r["zero0"]["memory"]
        assert memory["parameters"] == memory["gradients"] == 4 * numel
        assert memory["master_weights"] == 0
        assert 8 * numel <= memory["optimizer_state"] <= 8 * numel + 4 * 64  # + AdamW's step counters
        # ZeRO-1/2 add this rank's fp32 partition as master weights, about half the model.
        assert r["zero1"]["memory"]["master_weights"] == pytest.approx(2 * numel, rel=0.05)


@pytest.mark.parametrize("name", [n for n in SETUPS if n != "zero0"])
def test_every_stage_reaches_zero0_loss(results, name):
    for r in results:
        assert r[name]["losses"] == pytest.approx(r["zero0"]["losses"], abs=1e-4)
        assert r[name]["final"] == pytest.approx(r["zero0"]["final"], abs=1e-4)
    assert results[0]["zero0"]["final"] < results[0]["zero0"]["losses"][0]


def test_byte_counter_counts_shared_storage_once():
    flat = torch.zeros(100)
    counter = ByteCounter()
    assert counter.add([flat[:10], flat[5:20]]) == 20 * 4
    assert counter.add([flat]) == 80 * 4
    assert counter.add([flat[50:60], None, torch.zeros(3, dtype=torch.float16)]) == 6
    assert counter.cpu_bytes == 100 * 4 + 6
