"""fp16 dynamic loss scaling with the real DeepSpeed optimizers, the loss-scale guard, and every
bf16/fp16 ds_config of ds_configs/ training on 2 ranks (gloo)."""

import json
import math
from pathlib import Path

import deepspeed
import pytest
import torch

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.testing import run_distributed
from llmstack.training.precision import (
    LossScaleGuard,
    check_precision_supported,
    enable_fp16_on_cpu,
    loss_scale_metrics,
)

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
STAGES = (0, 1, 2, 3)
INITIAL_SCALE_POWER = 8
SCALE_WINDOW = 2
INF_STEP = 1  # the step whose loss rank 0 multiplies by inf
STEPS = INF_STEP + SCALE_WINDOW + 3


def tiny_model():
    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    return LLMStackForCausalLM(config)


def ds_config(name, **fp16):
    config = json.loads((DS_CONFIGS / f"{name}.json").read_text())
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=0.0)
    # torch's AdamW: DeepSpeed's fused Adam has no fp16 kernel for the CPU accelerator.
    config["optimizer"]["params"] = {"lr": 1e-3, "torch_adam": True}
    if "fp16" in config:
        config["fp16"].update(fp16)
    if config["zero_optimization"]["stage"] == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny tensors
    return config


def initialize(config):
    model = tiny_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(rank, step):
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def weights(engine):
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().float().reshape(-1) for p in params])


def train_step(engine, rank, step, planted_inf=False):
    loss = engine(input_ids=batch(rank, step), labels=batch(rank, step)).loss
    if planted_inf and rank == 0:  # one rank overflows; every rank must skip the step
        loss = loss * math.inf
    engine.backward(loss)
    engine.step()
    return loss.item()


def scale_cycle(engine, rank):
    """(loss scale, skipped steps, weights changed) after each step, inf planted at INF_STEP."""
    trace = []
    for step in range(STEPS):
        before = weights(engine)
        train_step(engine, rank, step, planted_inf=step == INF_STEP)
        metrics = loss_scale_metrics(engine)
        trace.append((metrics["loss_scale"], metrics["skipped_steps"], not torch.equal(before, weights(engine))))
    return trace


def guard_stop_step(engine, rank, patience):
    """Plant an inf on every step; the step at which LossScaleGuard stops the run, or None."""
    guard = LossScaleGuard(engine, patience=patience)
    for step in range(patience + 3):
        train_step(engine, rank, step, planted_inf=True)
        try:
            guard.after_step()
        except UserError as e:
            return step + 1, str(e)
    return None, ""


def check_all(rank, world_size):
    enable_fp16_on_cpu()
    cycles = {}
    for stage in STAGES:
        engine = initialize(
            ds_config(
                f"fp16_zero{stage}",
                initial_scale_power=INITIAL_SCALE_POWER,
                loss_scale_window=SCALE_WINDOW,
                hysteresis=1,
            )
        )
        cycles[stage] = scale_cycle(engine, rank)
    # Starting at the minimum scale, every planted inf is an overflow at the minimum.
    at_min = {"initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 1}
    guard_stops = {
        stage: guard_stop_step(initialize(ds_config(f"fp16_zero{stage}", **at_min)), rank, 3) for stage in (0, 2)
    }
    bf16_losses = {}
    for stage in STAGES:
        engine = initialize(ds_config(f"bf16_zero{stage}"))
        bf16_losses[stage] = [train_step(engine, rank, step) for step in range(3)]
    return {"cycles": cycles, "guard_stops": guard_stops, "bf16_losses": bf16_losses}


@pytest.fixture(scope="module")
def results():
    return run_distributed(check_all, world_size=2)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_skips_step_halves_scale_and_regrows(results, stage):
    initial = 2.0**INITIAL_SCALE_POWER
    for trace in (r["cycles"][stage] for r in results):
        scales, skipped, changed = zip(*trace)
        assert scales[:INF_STEP] == (initial,) * INF_STEP and changed[:INF_STEP] == (True,) * INF_STEP
        # The overflowing step is skipped on both ranks: no update, one skipped step, scale halved.
        assert scales[INF_STEP] == initial / 2 and skipped[INF_STEP] == 1 and not changed[INF_STEP]
        # Clean steps update again. DeepSpeed doubles the scale at the end of the first clean step
        # that follows loss_scale_window clean steps at the halved scale.
        assert all(changed[INF_STEP + 1 :]) and skipped[-1] == 1
        regrown = scales.index(initial, INF_STEP)
        assert regrown == INF_STEP + SCALE_WINDOW + 1
        assert set(scales[INF_STEP:regrown]) == {initial / 2}


@pytest.mark.parametrize("stage", (0, 2))
def test_guard_stops_after_consecutive_overflows_at_min_scale(results, stage):
    for r in results:
        stopped_at, message = r["guard_stops"][stage]
        assert stopped_at == 3
        assert "minimum loss scale" in message and "bf16" in message


def test_every_bf16_config_trains(results):
    for r in results:
        assert all(math.isfinite(x) for stage in STAGES for x in r["bf16_losses"][stage])
        # Same weights and data before the first update: the same loss at every stage.
        first = [r["bf16_losses"][stage][0] for stage in STAGES]
        assert max(first) - min(first) < 1e-2


def test_fp16_refused_on_cpu_before_training(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU accelerator reports fp16 when oneDNN has fp16 kernels (AVX-512 FP16/AMX CPUs)
    # and not otherwise; the refusal is tested as it behaves on CPUs without them.
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    config = json.loads((DS_CONFIGS / "fp16_zero2.json").read_text())
    with pytest.raises(UserError, match="fp16.*bf16"):
        check_precision_supported(config)
    # (bf16 on a CPU without native bf16 is refused on its own: tests/test_bf16_check.py)
    check_precision_supported(json.loads((DS_CONFIGS / "bf16_zero2.json").read_text()), allow_emulated_bf16=True)


def test_guard_refuses_zero_patience():
    class Engine:
        def fp16_enabled(self):
            return False

        def dynamic_loss_scale(self):
            return False

    with pytest.raises(UserError, match="patience"):
        LossScaleGuard(Engine(), patience=0)
