"""A shaped link for 2-rank benches: the bench re-executes itself inside a private network
namespace (`unshare -n`, so root) whose loopback, the only link its ranks share, is shaped with a
token bucket (`tc qdisc ... tbf`; this kernel has no netem).

    if args.link_mbit and (code := run_in_namespace()) is not None:
        return code           # the parent: the namespaced copy ran the bench
    ...
    shape_link(100)           # rank 0, between rounds; shape_link(None) removes the shaping
"""

import os
import subprocess
import sys
from collections.abc import Callable

IN_NAMESPACE = "LLMSTACK_BENCH_NETNS"


def run_in_namespace() -> int | None:
    """Outside the namespace: run this command again inside a new one and return its exit code.
    Inside it: bring its loopback up and return None (the caller goes on with the bench)."""
    if os.environ.get(IN_NAMESPACE) == "1":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return None
    command = ["unshare", "-n", sys.executable, *sys.argv]
    return subprocess.run(command, env={**os.environ, IN_NAMESPACE: "1"}).returncode


def shape_link(mbit: float | None) -> None:
    """Shape this namespace's loopback to `mbit` Mbit/s (None: unshaped)."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # absent at first
    if mbit is not None:
        rule = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb"]
        subprocess.run([*rule, "latency", "50ms"], check=True)


def measure_at_rates(measure: Callable, link_mbit: list[float], repeats: int, world_size: int) -> tuple[list, object]:
    """(rates, rank 0's result) of `measure(rank, world_size, rates, repeats, shaped)` run on
    `world_size` ranks, unshaped (None) and at each of `link_mbit`; the link is unshaped again after.
    Call it after `run_in_namespace()` has returned None (inside the private namespace)."""
    from llmstack.testing import run_distributed

    rates = [None, *(int(m) if m == int(m) else m for m in link_mbit)]
    try:
        result = run_distributed(measure, world_size=world_size, args=(rates, repeats, bool(link_mbit)), timeout=3600)
    finally:
        if link_mbit:
            shape_link(None)
    return rates, result[0]
