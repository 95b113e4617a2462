"""Training throughput: model FLOPs, tokens/s, TFLOP/s, MFU, step-time breakdown and memory.

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B) and Megatron-LM (Narayanan et al.
2021): a training step costs 6 FLOPs per matmul parameter per token (2 forward, 4 backward), plus
the attention score and value matmuls, 12 * layers * heads * head_dim * seq_len per token. They
count the work the model needs, not what the hardware did: activation recomputation is not
counted, so MFU stays comparable across memory-saving settings.
"""

import logging
import math
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from llmstack.errors import UserError

from .peak_flops import PeakFlops, measure_peak_flops, remeasured_peak_flops, resolve_peak_flops, synchronize

if TYPE_CHECKING:
    from llmstack.models import LLMStackConfig


logger = logging.getLogger(__name__)

__all__ = [
    "StepTimer",
    "ThroughputMeter",
    "flops_per_token",
    "format_flops",
    "matmul_params",
    "measure_peak_flops",
    "memory_gb",
]


def matmul_params(config: "LLMStackConfig") -> int:
    """Parameters that take part in a matmul per token: attention and MLP projections and the
    LM head. The embedding lookup and the norms do no matmul."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    attention = h * q_out + 2 * h * kv_out + q_out * h
    mlp_matrices = 3 if config.activation == "swiglu" else 2
    mlp = mlp_matrices * h * config.intermediate_size
    return layers * (attention + mlp) + h * config.vocab_size


def flops_per_token(config: "LLMStackConfig", seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token for an LLMStackConfig at this sequence length."""
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6 * matmul_params(config) + attention


class ThroughputMeter:
    """Turns (tokens, samples, seconds) of one logging interval into rates.

    tokens and samples are global (all data-parallel ranks together); TFLOP/s and MFU are per
    device, which is how papers and dashboards report them. MFU is never above 1: a rate past a
    measured peak shows that peak was taken under load, so it is measured again (once); a rate
    still past it (or past a configured or table peak) makes MFU NaN, with a warning saying why.
    """

    def __init__(
        self,
        flops_per_token: float,
        num_devices: int = 1,
        peak_flops: float | PeakFlops | None = None,
        remeasure: Callable[[PeakFlops], PeakFlops] | None = None,
    ) -> None:
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.peak = PeakFlops(peak_flops, "given") if isinstance(peak_flops, (int, float)) else peak_flops
        self.remeasure = remeasure

    @property
    def peak_flops(self) -> float | None:
        return self.peak.flops if self.peak else None

    @classmethod
    def from_config(
        cls,
        monitor_cfg: Mapping[str, Any] | None,
        model_config: "LLMStackConfig",
        seq_len: int,
        num_devices: int,
        dtype: torch.dtype = torch.float32,
    ) -> "ThroughputMeter":
        """The meter for a run: MFU against `monitor.peak_tflops` (per device) when the config sets
        it, else the GPU's dense peak in the training dtype, else a measured matmul rate (see
        llmstack.monitor.peak_flops)."""
        peak_tflops = (monitor_cfg or {}).get("peak_tflops")
        if peak_tflops is not None and (not isinstance(peak_tflops, (int, float)) or peak_tflops <= 0):
            raise UserError(
                f"monitor.peak_tflops must be a positive number (e.g. 989 for an H100 in bf16); got {peak_tflops!r}"
            )
        peak = resolve_peak_flops(dtype, peak_tflops)
        logger.info("MFU against %s (%s: %s)", format_flops(peak.flops), peak.source, peak.detail)
        return cls(
            flops_per_token(model_config, seq_len), num_devices, peak, partial(remeasured_peak_flops, dtype=dtype)
        )

    def rates(self, tokens: float, samples: float, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / seconds
        flops_per_device = tokens_per_s * self.flops_per_token / self.num_devices
        rates = {
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples / seconds,
            "tflops": flops_per_device / 1e12,
        }
        if self.peak:
            rates["mfu"] = self._utilization(flops_per_device)
        return rates

    def _utilization(self, flops: float) -> float:
        assert self.peak is not None
        if flops > self.peak.flops and self.remeasure and self.peak.cache_key is not None:
            stale = self.peak
            self.peak = self.remeasure(stale)
            logger.warning(
                "achieved %s, above the measured peak %s: re-measured the peak: %s",
                format_flops(flops),
                format_flops(stale.flops),
                format_flops(self.peak.flops),
            )
        if flops <= self.peak.flops:
            return flops / self.peak.flops
        logger.warning(
            "MFU not reported: achieved %s is above the peak %s (%s: %s); set monitor.peak_tflops to this "
            "device's peak",
            format_flops(flops),
            format_flops(self.peak.flops),
            self.peak.source,
            self.peak.detail,
        )
        return math.nan


def format_flops(flops_per_s: float) -> str:
    """FLOP/s with a unit that keeps 3 significant digits: '812 GFLOP/s', '3.20 MFLOP/s'."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("kFLOP/s", 1e3)):
        if abs(flops_per_s) >= scale:
            return f"{flops_per_s / scale:.3g} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


class StepTimer:
    """Wall time of the phases of a training step, summed over a logging interval.

        with timer.phase("forward"):
            loss = engine(batch)
        ...
        metrics.update(timer.pop(steps=10))   # {"time/forward": mean seconds per step, ...}

    Accelerator work is asynchronous, so each phase ends with a device synchronize; that costs a
    little throughput and buys a breakdown that means something.
    """

    def __init__(
        self, device: torch.device | str | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.clock = clock
        self.totals: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            synchronize(self.device)
            self.totals[name] += self.clock() - start

    def pop(self, steps: int = 1) -> dict[str, float]:
        """Mean seconds per step of each phase since the last pop, keyed "time/<phase>"."""
        means = {f"time/{name}": total / steps for name, total in self.totals.items()}
        self.totals.clear()
        return means


def memory_gb(device: torch.device | str | None = None) -> float:
    """Peak memory of this process in GiB: the accelerator's max allocated, or the CPU peak RSS."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
