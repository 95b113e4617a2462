"""MFU that can be trusted: GPU peaks from a table, CPU peaks the best of several runs and cached
per machine, MFU never above 100%, FLOP/s in a unit that shows small rates. Clocks, measurements and
caches are injected: nothing here depends on how fast this machine is."""

import logging
import math

import pytest
import torch

from llmstack.monitor.console import format_summary
from llmstack.monitor.peak_flops import (
    MeasuredPeakCache,
    PeakFlops,
    machine_key,
    measure_peak_flops,
    remeasured_peak_flops,
    resolve_peak_flops,
    table_peak_flops,
)
from llmstack.monitor.throughput import ThroughputMeter, format_flops


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.0),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA A10G", "bf16", 70.0),
        ("NVIDIA A10", "fp32", 31.2),
    ],
)
def test_gpu_peaks_come_from_the_dense_table(name, dtype, tflops):
    assert table_peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unlisted_gpus_and_dtypes_have_no_table_peak():
    assert table_peak_flops("Some Future GPU", "bf16") is None
    assert table_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores


def test_measured_peak_is_the_best_of_several_runs():
    # Each run times one matmul of 8^3 (the clock moves only when read): 1 s while busy, then 0.25 s.
    ticks = iter([0.0, 1.0, 1.0, 1.25, 1.25, 2.25])
    peak = measure_peak_flops("cpu", size=8, seconds=0.3, runs=3, clock=lambda: next(ticks))
    assert peak == pytest.approx(2 * 8**3 / 0.25)


def test_a_measured_peak_is_cached_per_machine_and_only_raised(tmp_path):
    cache = MeasuredPeakCache(tmp_path / "peak_flops.json")
    peak = resolve_peak_flops(torch.float32, device="cpu", cache=cache, measure=lambda dtype: 5e10)
    assert (peak.flops, peak.source, peak.cache_key) == (5e10, "measured", machine_key(torch.float32))
    assert str(torch.get_num_threads()) in peak.cache_key and torch.__version__ in peak.cache_key

    def no_measurement(dtype):
        raise AssertionError("the cached peak should be used")

    assert resolve_peak_flops(torch.float32, device="cpu", cache=cache, measure=no_measurement).flops == 5e10
    assert cache.raise_to(peak.cache_key, 1e10) == 5e10  # a slower measurement does not lower it
    assert resolve_peak_flops(torch.float32, 2.0, device="cpu", cache=cache).flops == 2e12  # the config wins


def test_mfu_above_a_measured_peak_remeasures_it(tmp_path, caplog):
    cache = MeasuredPeakCache(tmp_path / "peak_flops.json")
    stale = PeakFlops(1e9, "measured", "taken under load", cache_key="cpu x")
    meter = ThroughputMeter(
        flops_per_token=1e6,
        peak_flops=stale,
        remeasure=lambda peak: remeasured_peak_flops(peak, torch.float32, cache=cache, measure=lambda d: 4e9),
    )
    with caplog.at_level(logging.WARNING):
        mfu = meter.rates(tokens=2000, samples=1, seconds=1.0)["mfu"]  # 2 GFLOP/s achieved
    assert mfu == pytest.approx(0.5)
    assert "re-measured the peak" in caplog.text
    assert cache.get("cpu x") == 4e9


def test_mfu_above_a_peak_that_stays_below_is_not_reported(caplog):
    meter = ThroughputMeter(flops_per_token=1e6, peak_flops=PeakFlops(1e9, "config", "monitor.peak_tflops 0.001"))
    with caplog.at_level(logging.WARNING):
        rates = meter.rates(tokens=2000, samples=1, seconds=1.0)
    assert math.isnan(rates["mfu"])
    assert "MFU not reported" in caplog.text and "monitor.peak_tflops" in caplog.text
    assert "MFU n/a" in format_summary(1, rates)


@pytest.mark.parametrize(
    ("flops", "text"),
    [(4.51e13, "45.1 TFLOP/s"), (8.12e11, "812 GFLOP/s"), (3.2e6, "3.2 MFLOP/s"), (12.0, "12 FLOP/s")],
)
def test_flops_print_in_a_unit_that_shows_them(flops, text):
    assert format_flops(flops) == text


def test_the_console_line_shows_small_flop_rates_and_mfu():
    line = format_summary(3, {"tflops": 0.0042, "mfu": 0.5})
    assert "4.2 GFLOP/s" in line and "MFU 50.0%" in line
