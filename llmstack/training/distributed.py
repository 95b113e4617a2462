"""Process-group start-up that works under the deepspeed/torchrun launchers and as a plain process."""

import contextlib
import os
import re
from collections.abc import Iterator

import deepspeed
import torch.distributed as dist

from llmstack.compat.deepspeed import remove_stale_allreduce_buffers, unlink_allreduce_buffer
from llmstack.errors import UserError
from llmstack.net import free_port


def init_distributed() -> tuple[int, int]:
    """Join (or, for a plain `python` run, create) the default process group; returns (rank, world_size).

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
    deepspeed.init_distributed(verbose=False)  # adopts a process group that already exists
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


# What gloo (and NCCL's socket transport) say when the other end of a connection has gone.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|ECONNRESET", re.IGNORECASE)


@contextlib.contextmanager
def peer_loss_reported() -> Iterator[None]:
    """A collective that fails because another rank died (killed, out of memory, a crash) becomes
    one line naming that, instead of the backend's traceback on every surviving rank."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed.DistError and its subclasses are RuntimeErrors
        if not PEER_LOST.search(str(e)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        first_line = str(e).strip().splitlines()[0]
        raise UserError(
            f"rank {rank} lost its connection to another rank of the job, which has died or been killed "
            f"({first_line}); what was trained since the last checkpoint is lost: rerun with --resume auto"
        ) from None
