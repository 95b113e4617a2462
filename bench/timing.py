"""What the benchmarks share: the baseline model shape, timing helpers and the resident-set peak."""

import time
from pathlib import Path

# The 13.8M-parameter model of the baselines in /work/shared/FACTS.md (hidden 384, 6 layers, 6 heads,
# FFN 1024, vocabulary 8192).
BASELINE_MODEL = dict(
    vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6
)


def best_time(fn, repeats=3):
    """The fastest of `repeats` runs of fn(), in seconds: the least disturbed by other load."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_times(fn, repeats=3):
    """The times of `repeats` runs of fn(), in seconds, sorted (min, ..., max)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident_bytes() -> int:
    """This process's resident set now (Linux)."""
    return _status_bytes("VmRSS")


def resident_peak_bytes() -> int:
    """This process's peak resident set since it started or since `reset_resident_peak`."""
    return _status_bytes("VmHWM")


def reset_resident_peak() -> None:
    """Make the peak resident set the current one (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")
