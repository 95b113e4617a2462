"""Process-group start-up that works under the deepspeed/torchrun launchers and as a plain process."""

import os

import deepspeed
import torch.distributed as dist

from llmstack.net import free_port


def init_distributed() -> tuple[int, int]:
    """Join (or, for a plain `python` run, create) the default process group; returns (rank, world_size).

    A plain process gets the environment a launcher would give a single rank, so the same code
    path runs everywhere. DeepSpeed picks the backend: NCCL on GPUs, gloo on CPU.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    deepspeed.init_distributed(verbose=False)  # adopts a process group that already exists
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Leave the process group together: a rank that exits while a peer still talks to it can
    take the whole launch down (gloo aborts the process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
