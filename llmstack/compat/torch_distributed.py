"""The one torch.distributed internal llmstack uses: the default timeout of process groups.

`torch.distributed.new_group` without a `timeout` gives a group torch's default (30 minutes), not
the default group's; DeepSpeed creates its data-parallel and ZeRO groups that way. So a run's
collective timeout reaches every group only by setting that default before any group exists.
Importing this module checks that torch still keeps the default where llmstack sets it.
"""

from datetime import timedelta

import torch
import torch.distributed.distributed_c10d as c10d

from . import IncompatibleLibraryError

# The module globals `_get_default_timeout` reads (the NCCL one exists in every build, None without NCCL).
DEFAULT_TIMEOUT_NAMES = ("default_pg_timeout", "default_pg_nccl_timeout", "_get_default_timeout")


def check_installed() -> None:
    missing = [name for name in DEFAULT_TIMEOUT_NAMES if not hasattr(c10d, name)]
    if missing:
        raise IncompatibleLibraryError(
            f"torch {torch.__version__} lacks torch.distributed.distributed_c10d.{', '.join(missing)}, where "
            "llmstack sets the collective timeout of every process group; install a torch of 2.4 to 2.13"
        )


def set_default_collective_timeout(timeout: timedelta) -> None:
    """Every process group created from now on without a timeout of its own waits `timeout` for a
    collective (gloo and NCCL alike)."""
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout


def default_collective_timeout() -> timedelta:
    return c10d.default_pg_timeout


check_installed()
