"""Peak FLOP/s per device, the denominator of MFU.

On GPUs: the vendor's dense (no sparsity) tensor-core figure for the device and dtype, as
torchtitan's `get_peak_flops` does. On CPUs (and GPUs missing from the table): a measured matmul
rate that a momentary load cannot fool: the best of several short runs, kept per machine in
~/.cache/llmstack/peak_flops.json ($LLMSTACK_CACHE_DIR moves it; keyed by CPU model, torch
version, threads and dtype) and raised whenever a later measurement is higher.
`monitor.peak_tflops` in the run config overrides both.
"""

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense TFLOP/s by GPU name fragment (checked in this order, first match wins) and dtype, from the
# vendors' data sheets (sparsity figures halved). "fp32" is plain fp32 (no tensor cores); "tf32" is
# fp32 matmuls on tensor cores (torch.set_float32_matmul_precision("high")).
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("H20", {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    ("MI250X", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)


def cache_file() -> Path:
    """Where measured peaks are kept: $LLMSTACK_CACHE_DIR (tests point it at a temporary folder), else
    ~/.cache/llmstack."""
    root = os.environ.get("LLMSTACK_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "llmstack") / "peak_flops.json"


@dataclass(frozen=True)
class PeakFlops:
    """A peak FLOP/s, where it came from ("config", "table", "measured", "given") and, for a
    measured one, its key in the cache."""

    flops: float
    source: str
    detail: str = ""
    cache_key: str | None = None


def dtype_key(dtype: torch.dtype) -> str:
    """The table's name for matmuls in `dtype` (fp32 on CUDA is tf32 when torch allows it)."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if torch.cuda.is_available() and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def table_peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the named GPU in `dtype` ("bf16", "fp16", "tf32", "fp32"), None if not listed."""
    for fragment, peaks in GPU_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    size: int = 2048,
    seconds: float = 1.0,
    runs: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The best matmul FLOP/s of `runs` runs of about seconds/runs each on square `size` matrices
    (after one warm-up matmul): a busy moment slows some runs, not all of them."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    synchronize(device)
    best = 0.0
    for _ in range(runs):
        iters, start = 0, clock()
        while True:
            torch.matmul(a, b)
            iters += 1
            synchronize(device)
            elapsed = clock() - start
            if elapsed >= seconds / runs:
                break
        best = max(best, 2 * size**3 * iters / elapsed)
    return best


def machine_key(dtype: torch.dtype) -> str:
    """What a measured CPU peak depends on: CPU model, torch version, threads, dtype."""
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype_key(dtype)}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class MeasuredPeakCache:
    """Best measured peaks per machine key, in a JSON file (written atomically)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_file()

    def get(self, key: str) -> float | None:
        try:
            value = json.loads(self.path.read_text()).get(key)
        except (OSError, ValueError):
            return None
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def raise_to(self, key: str, flops: float) -> float:
        """Store max(stored, flops) under key and return it (an unwritable cache is skipped)."""
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        best = max(flops, float(entries.get(key) or 0.0))
        entries[key] = best
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:
            pass
        return best


def resolve_peak_flops(
    dtype: torch.dtype,
    configured_tflops: float | None = None,
    device: torch.device | str | None = None,
    cache: MeasuredPeakCache | None = None,
    measure: Callable[[torch.dtype], float] | None = None,
) -> PeakFlops:
    """The peak for MFU: the config's, else the GPU table's, else the cached or measured best."""
    if configured_tflops is not None:
        return PeakFlops(configured_tflops * 1e12, "config", f"monitor.peak_tflops {configured_tflops:g}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        listed = table_peak_flops(name, dtype_key(dtype))
        if listed:
            return PeakFlops(listed, "table", f"{name} {dtype_key(dtype)} dense")
        key = f"{name} | torch {torch.__version__} | {dtype_key(dtype)}"
    else:
        key = machine_key(dtype)
    cache = cache or MeasuredPeakCache()
    cached = cache.get(key)
    if cached:
        return PeakFlops(cached, "measured", f"best matmul rate cached in {cache.path}", key)
    flops = cache.raise_to(key, (measure or (lambda d: measure_peak_flops(device, d)))(dtype))
    return PeakFlops(flops, "measured", "best matmul rate of several runs", key)


def remeasured_peak_flops(
    peak: PeakFlops,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    cache: MeasuredPeakCache | None = None,
    measure: Callable[[torch.dtype], float] | None = None,
) -> PeakFlops:
    """A measured peak raised by a new measurement (when the achieved rate passed it, the old
    one was taken under load); config and table peaks are returned as they are."""
    if peak.cache_key is None:
        return peak
    flops = (measure or (lambda d: measure_peak_flops(device, d)))(dtype)
    best = (cache or MeasuredPeakCache()).raise_to(peak.cache_key, max(flops, peak.flops))
    return PeakFlops(best, "measured", "best matmul rate, re-measured", peak.cache_key)
