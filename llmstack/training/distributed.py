"""Process-group start-up that works under the deepspeed/torchrun launchers and as a plain process."""

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import deepspeed
import torch.distributed as dist

from llmstack.compat.deepspeed import remove_stale_allreduce_buffers, unlink_allreduce_buffer
from llmstack.compat.torch_distributed import default_collective_timeout, set_default_collective_timeout
from llmstack.errors import UserError
from llmstack.net import free_port

from .config import TrainConfig


def init_distributed(collective_timeout_s: float = TrainConfig.collective_timeout_s) -> tuple[int, int]:
    """Join (or, for a plain `python` run, create) the default process group; returns (rank, world_size).

    Every process group of the run (llmstack's, DeepSpeed's) fails a collective that waits more
    than `collective_timeout_s` for another rank, so that a hung rank ends the run (see
    `peer_failures_reported`) instead of stalling it.

    A plain process gets the environment a launcher would give a single rank, so the same code
    path runs everywhere. DeepSpeed picks the backend: NCCL on GPUs, gloo on CPU.

    On CPU, DeepSpeed's all-reduce maps one /dev/shm file per rank and leaves them behind: the
    stale ones of ended jobs are removed first, and this job's names as soon as every rank has
    mapped them (see llmstack.compat.deepspeed), so nothing of the run stays in /dev/shm.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    remove_stale_allreduce_buffers()
    timeout = timedelta(seconds=collective_timeout_s)
    set_default_collective_timeout(timeout)
    deepspeed.init_distributed(verbose=False, timeout=timeout)  # adopts a process group that already exists
    rank = dist.get_rank()
    dist.barrier()  # every rank has mapped every rank's buffer
    unlink_allreduce_buffer(rank)
    return rank, dist.get_world_size()


def shutdown_distributed() -> None:
    """Leave the process group together: a rank that exits while a peer still talks to it can
    take the whole launch down (gloo aborts the process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# What gloo (and NCCL's socket transport) say when the other end of a connection has gone, and
# when a collective has waited out the process group's timeout.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|ECONNRESET", re.IGNORECASE)
TIMED_OUT = re.compile(r"Timed out waiting|operation timed out", re.IGNORECASE)

# After a timeout, how long the ranks that are still alive wait for each other in the roll call.
ROLL_CALL_S = 5.0
ROLL_CALL_KEY = "llmstack/roll_call/{rank}"


@contextlib.contextmanager
def peer_failures_reported() -> Iterator[None]:
    """A collective that fails because another rank died (killed, out of memory, a crash) or hung
    (stopped, deadlocked) becomes one line naming that, instead of the backend's traceback on every
    surviving rank. The run exits non-zero, so that a restart loop or an elastic agent starts it
    again, to resume from its last checkpoint."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed.DistError and its subclasses are RuntimeErrors
        message = str(e)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", -1))
        first_line = message.strip().splitlines()[0] if message.strip() else type(e).__name__
        if PEER_LOST.search(message):
            raise UserError(
                f"rank {rank} lost its connection to another rank of the job, which has died or been killed "
                f"({first_line}); what was trained since the last checkpoint is lost: rerun with --resume auto"
            ) from None
        if TIMED_OUT.search(message) and dist.is_initialized():
            waited = default_collective_timeout().total_seconds()
            raise UserError(
                f"rank {rank} waited {waited:g} s (train.collective_timeout_s) in a collective for another rank: "
                f"{absent_ranks_text(roll_call(rank, dist.get_world_size()))}; it hangs (stopped, deadlocked or "
                "stuck in I/O); what was trained since the last checkpoint is lost: rerun with --resume auto"
            ) from None
        raise


def roll_call(rank: int, world_size: int, window_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that do not answer within `window_s`: each rank that is still alive writes its key
    to the job's rendezvous store (MASTER_ADDR:MASTER_PORT), waits, and reads which keys are there.
    None when the store itself does not answer: under the deepspeed launcher rank 0 hosts it, so
    then rank 0 is the one that hangs."""
    absent: list[int] = []
    answered = threading.Event()

    def ask() -> None:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=timedelta(seconds=window_s),
            wait_for_workers=False,
        )
        store.set(ROLL_CALL_KEY.format(rank=rank), "here")
        time.sleep(window_s)
        absent.extend(r for r in range(world_size) if not store.check([ROLL_CALL_KEY.format(rank=r)]))
        answered.set()

    # A store whose host is stopped accepts the connection and never replies: wait in a thread.
    threading.Thread(target=ask, name="llmstack-roll-call", daemon=True).start()
    return absent if answered.wait(window_s + 5.0) else None


def absent_ranks_text(absent: list[int] | None) -> str:
    if absent is None:
        return "rank 0 did not arrive (nor does the job's rendezvous store, which it hosts, answer)"
    if not absent:
        return "every rank answered a roll call afterwards, so one was slower than the timeout"
    ranks = ", ".join(map(str, absent))
    return f"rank{'s' if len(absent) > 1 else ''} {ranks} did not arrive (nor answer a roll call)"
