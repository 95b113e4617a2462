"""Training throughput: model FLOPs, tokens/s, TFLOP/s, MFU, step-time breakdown and memory.

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B) and Megatron-LM (Narayanan et al.
2021): a training step costs 6 FLOPs per matmul parameter per token (2 forward, 4 backward), plus
the attention score and value matmuls, 12 * layers * heads * head_dim * seq_len per token. They
count the work the model needs, not what the hardware did: activation recomputation is not
counted, so MFU stays comparable across memory-saving settings.
"""

import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from llmstack.errors import UserError

if TYPE_CHECKING:
    from llmstack.models import LLMStackConfig


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


def measure_peak_flops(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, size: int = 2048, seconds: float = 1.0
) -> float:
    """Matmul FLOP/s this device reaches on square `size` matrices: the denominator of MFU when
    the user gives no peak. Runs for about `seconds` after one warm-up matmul."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    _synchronize(device)
    iters, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        iters += 1
        _synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size**3 * iters / elapsed


class ThroughputMeter:
    """Turns (tokens, samples, seconds) of one logging interval into rates.

    tokens and samples are global (all data-parallel ranks together); TFLOP/s and MFU are per
    device, which is how papers and dashboards report them.
    """

    def __init__(self, flops_per_token: float, num_devices: int = 1, peak_flops: float | None = None) -> None:
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.peak_flops = peak_flops

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
        it, else against the matmul rate measured here in the training dtype."""
        peak_tflops = (monitor_cfg or {}).get("peak_tflops")
        if peak_tflops is None:
            peak_flops = measure_peak_flops(dtype=dtype)
        elif isinstance(peak_tflops, (int, float)) and peak_tflops > 0:
            peak_flops = peak_tflops * 1e12
        else:
            raise UserError(
                f"monitor.peak_tflops must be a positive number (e.g. 989 for an H100 in bf16); got {peak_tflops!r}"
            )
        return cls(flops_per_token(model_config, seq_len), num_devices, peak_flops)

    def rates(self, tokens: float, samples: float, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / seconds
        flops_per_device = tokens_per_s * self.flops_per_token / self.num_devices
        rates = {
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples / seconds,
            "tflops": flops_per_device / 1e12,
        }
        if self.peak_flops:
            rates["mfu"] = flops_per_device / self.peak_flops
        return rates


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
            _synchronize(self.device)
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
