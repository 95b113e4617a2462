import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from llmstack.errors import UserError
from llmstack.models.configuration_llmstack import LLMStackConfig
from llmstack.models.modeling_llmstack import LLMStackForCausalLM
from llmstack.monitor.throughput import (
    StepTimer,
    ThroughputMeter,
    flops_per_token,
    matmul_params,
    measure_peak_flops,
)


def tiny_config(**overrides):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    return LLMStackConfig(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_heads=2),
        dict(activation="gelu", tie_word_embeddings=False),
    ],
    ids=["swiglu-gqa-tied", "gelu-mha-untied"],
)
def test_flops_per_token_equals_counted_training_flops(overrides):
    """The analytic count equals what torch's FLOP counter sees in a forward + backward pass
    (the math SDPA backend makes the attention matmuls visible to the counter)."""
    config = tiny_config(**overrides)
    model = LLMStackForCausalLM(config)
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(config) == linear_weights

    batch, seq = 2, 32
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).loss.backward()
    assert counter.get_total_flops() == flops_per_token(config, seq) * batch * seq


def test_throughput_rates_are_global_tokens_and_per_device_flops():
    meter = ThroughputMeter(flops_per_token=1e6, num_devices=4, peak_flops=1e12)
    rates = meter.rates(tokens=8000, samples=16, seconds=2.0)
    assert rates["tokens_per_s"] == 4000
    assert rates["samples_per_s"] == 8
    assert rates["tflops"] == pytest.approx(4000 * 1e6 / 4 / 1e12)
    assert rates["mfu"] == pytest.approx(4000 * 1e6 / 4 / 1e12)
    assert "mfu" not in ThroughputMeter(flops_per_token=1e6).rates(100, 1, 1.0)


def test_meter_from_config_uses_the_configured_peak_or_measures_one():
    config = tiny_config()
    meter = ThroughputMeter.from_config({"peak_tflops": 2.5}, config, seq_len=32, num_devices=2)
    assert (meter.peak_flops, meter.flops_per_token, meter.num_devices) == (2.5e12, flops_per_token(config, 32), 2)
    assert ThroughputMeter.from_config({}, config, seq_len=32, num_devices=1).peak_flops > 1e8
    with pytest.raises(UserError, match="peak_tflops must be a positive number"):
        ThroughputMeter.from_config({"peak_tflops": "fast"}, config, seq_len=32, num_devices=1)


def test_step_timer_reports_mean_seconds_per_phase_and_resets():
    now = [0.0]
    timer = StepTimer(device="cpu", clock=lambda: now[0])  # a clock the test moves, not the machine's
    for _ in range(2):
        with timer.phase("forward"):
            now[0] += 0.25
        with timer.phase("optimizer"):
            now[0] += 0.5
    times = timer.pop(steps=2)
    assert times == {"time/forward": 0.25, "time/optimizer": 0.5}
    assert timer.pop() == {}


MEMORY_PROBE = """
import torch
from llmstack.monitor.throughput import memory_gb
before = memory_gb("cpu")
# Linux carries the parent's resident size into a child's peak at exec: allocate past it by 512 MiB,
# written so the pages are resident.
block = torch.ones(int((before + 0.5) * 2**30) // 4)
print(before, memory_gb("cpu"), float(block.sum()))
"""


def test_memory_gb_sees_a_large_allocation():
    # A fresh process: the peak RSS of this one depends on which tests ran before.
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, check=True)
    before, after, _ = map(float, result.stdout.split())
    assert after - before >= 0.45


def test_measured_peak_is_a_real_matmul_rate():
    peak = measure_peak_flops("cpu", size=256, seconds=0.2)
    assert 1e8 < peak < 1e14


def test_a_straggler_is_named_after_patience_intervals_when_its_lateness_costs_the_step(caplog):
    from llmstack.monitor.stragglers import NO_STRAGGLER, StragglerWatch

    watch = StragglerWatch(factor=2.0, patience=2)
    slow = ([0.1, 0.1, 0.5, 0.1], [0.0, 0.0, 0.4, 0.0])  # rank 2: 5x the others, 0.4 s late
    assert watch.metrics(*slow, step_s=1.0)["straggler/rank"] == NO_STRAGGLER  # once is not yet
    named = watch.metrics(*slow, step_s=1.0)
    assert named == {"straggler/ratio": 5.0, "straggler/rank": 2, "straggler/data_wait_s": 0.4}
    assert "rank 2 is a straggler: 5.0x" in caplog.text
    # 0.4 s late in a 10 s step (under a tenth of it) costs little: not a straggler, and it starts over
    assert watch.metrics(*slow, step_s=10.0)["straggler/rank"] == NO_STRAGGLER
    assert watch.metrics(*slow, step_s=1.0)["straggler/rank"] == NO_STRAGGLER
    # another rank slowest breaks the run of intervals
    assert watch.metrics([0.5, 0.1, 0.1, 0.1], [0.0] * 4, step_s=1.0)["straggler/rank"] == NO_STRAGGLER
    assert StragglerWatch(factor=0.0).metrics(*slow, step_s=1.0)["straggler/rank"] == NO_STRAGGLER
