"""Timing helper shared by the benchmarks."""

import time


def best_time(fn, repeats=3):
    """The fastest of `repeats` runs of fn(), in seconds: the least disturbed by other load."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
