"""What the benchmarks share: the baseline model shape and a timing helper."""

import time

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
