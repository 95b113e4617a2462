"""Run a function on N local processes joined by a gloo process group (tests and benchmarks).

    results = run_distributed(fn, world_size=2, args=(...))   # fn(rank, world_size, *args)

Each process gets the environment the `deepspeed`/`torchrun` launchers set (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so code under test sees what it would see when launched
for real. `fn` must be importable (a module-level function); its return values come back in rank
order. An exception on any rank is re-raised here with that rank's traceback. The port is picked
free but bound later by rank 0, so another process can take it in between (busy CI machines): the
launch is then retried on another port, before `fn` has run anywhere.
"""

import os
import time
import traceback
from collections.abc import Callable, Sequence
from queue import Empty
from typing import Any

import torch.multiprocessing as mp

from llmstack.net import free_port


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    queue: Any,
    collected: Any,
    threads: int,
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except dist.DistNetworkError as error:
            if "EADDRINUSE" not in str(error):
                raise
            queue.put((rank, None, PORT_TAKEN))
            return
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Tensors travel as shared-memory handles the parent opens through this process: it must
        # stay alive until the parent has received every result.
        collected.wait(timeout=600)
        if dist.is_initialized():
            dist.destroy_process_group()


PORT_TAKEN = "the rendezvous port was taken before rank 0 bound it"
LAUNCH_ATTEMPTS = 3


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (), timeout: float = 600, threads: int = 1
) -> list[Any]:
    attempts_left = LAUNCH_ATTEMPTS
    while True:
        try:
            return _launch(fn, world_size, args, timeout, threads)
        except _PortTaken:
            attempts_left -= 1
            if not attempts_left:
                raise


class _PortTaken(RuntimeError):
    pass


def _launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float, threads: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, collected, threads))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    port_taken = False
    deadline = time.monotonic() + timeout  # a guard against a hang, not a performance bound
    while len(results) < world_size and not errors:
        try:
            rank, ok, value = queue.get(timeout=1)
        except Empty:
            # A rank that crashed (a signal, os._exit, an abort in native code) sends nothing.
            crashed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if crashed:
                errors.append("".join(f"rank {r} exited with code {code} without a result\n" for r, code in crashed))
            elif time.monotonic() > deadline:
                errors.append(f"no result after {timeout} s")
            continue
        if ok is None:
            port_taken = True
            errors.append(f"rank {rank}: {value} (port {port})")
        else:
            (results.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
    collected.set()
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise (_PortTaken if port_taken else RuntimeError)("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
