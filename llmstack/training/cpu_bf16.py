"""Whether this CPU computes bf16 natively (AVX512-BF16 or AMX on x86, the BF16 extension on Arm).

Elsewhere torch emulates bf16, about 30x slower than fp32 (a 2048^3 matmul took 55 s on an
AVX2-only EPYC). Plain torch, no DeepSpeed: `llmstack doctor` reports it even where DeepSpeed is
broken, and training.precision refuses emulated bf16 runs with it.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# /proc/cpuinfo flags that mean native bf16 matmuls (x86: AVX512-BF16, AMX; Arm: the BF16 extension).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# A bf16 matmul slower than this fraction of fp32's is emulated (native: 1-4x fp32; emulated ~0.03x).
MIN_BF16_SPEED_RATIO = 0.5
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CpuBf16Report:
    """What this CPU offers bf16: torch's capability level, the native-bf16 flags found and, when
    probed, the speed of a bf16 matmul relative to fp32."""

    capability: str
    flags: tuple[str, ...]
    speed_ratio: float | None = None

    @property
    def native(self) -> bool:
        return bool(self.flags) or (self.speed_ratio is not None and self.speed_ratio >= MIN_BF16_SPEED_RATIO)

    def describe(self) -> str:
        flags = ", ".join(self.flags) or "no " + "/".join(NATIVE_BF16_FLAGS[:2]) + " flags"
        probe = "" if self.speed_ratio is None else f"; a bf16 matmul ran at {self.speed_ratio:.3g}x fp32"
        return f"{'native' if self.native else 'emulated'} (capability {self.capability}, {flags}{probe})"


def cpu_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The native-bf16 flags in /proc/cpuinfo (or the given text); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            found.update(value.split())
    return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in found)


def bf16_speed_ratio(size: int = 512, clock: Callable[[], float] = time.perf_counter) -> float:
    """bf16 / fp32 matmul rate on `size`^3: the best of 3 alternating runs of each (after a warm-up),
    so that a busy moment hits both; under a second even where bf16 is emulated."""
    operands = {dtype: (torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)) for dtype in DTYPES}
    seconds = dict.fromkeys(DTYPES, float("inf"))
    for a, b in operands.values():
        torch.matmul(a, b)
    for _ in range(3):
        for dtype, (a, b) in operands.items():
            start = clock()
            torch.matmul(a, b)
            seconds[dtype] = min(seconds[dtype], max(clock() - start, 1e-9))
    return seconds[torch.float32] / seconds[torch.bfloat16]


def cpu_bf16_report(probe: bool = False) -> CpuBf16Report:
    """This CPU's bf16 support: flags first; the timed probe runs when `probe` or when no flag says native."""
    flags = cpu_bf16_flags()
    ratio = bf16_speed_ratio() if probe or not flags else None
    return CpuBf16Report(torch.backends.cpu.get_cpu_capability(), flags, ratio)
