"""Bytes moved by collective kind, counted at the dispatcher.

Every torch.distributed collective, whoever calls it (these layers, DeepSpeed's engine, ZeRO, the
pipeline's sends), reaches the dispatcher as a `c10d` operator, so a dispatch mode sees them all
without patching any library. Sizes follow nccl-tests' convention: the bytes of the whole buffer
the collective is about (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter:
the unreduced input; broadcast, send, recv: the tensor), as seen by this rank. What a ring
algorithm puts on the wire per rank is that times 2(n-1)/n for all-reduce, (n-1)/n for all-gather
and reduce-scatter.

    stats = CommStats()
    with stats:
        ...one training step...
    logger.log(stats.as_metrics())      # {"comm/all_reduce_bytes": ..., ...}
    stats.reset()

A Python dispatch mode costs a little on every operator, so a trainer measures one step per
logging interval rather than all of them.
"""

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "point_to_point", "all_to_all")

# c10d operator -> (kind, index of the argument holding the buffer that is counted)
_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("point_to_point", 0),
    "recv_": ("point_to_point", 0),
    "recv_any_source_": ("point_to_point", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
}


def _nbytes(arg: object) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    return 0


class CommStats(TorchDispatchMode):
    """Counts bytes and calls per collective kind while active (a context manager, re-enterable)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "c10d":
            kind, index = _OPS.get(func._opname, (None, 0))
            if kind is not None:
                self.bytes[kind] += _nbytes(args[index])
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def as_metrics(self, prefix: str = "comm/") -> dict[str, int]:
        """{prefix + kind + "_bytes": bytes} for every kind, zeros included, plus the total."""
        metrics = {f"{prefix}{kind}_bytes": self.bytes[kind] for kind in KINDS}
        metrics[f"{prefix}total_bytes"] = sum(self.bytes.values())
        return metrics
