"""Data-parallel gradient averaging that overlaps the backward pass: each bucket of gradients is
sent as soon as backward has produced it, while backward goes on with the earlier layers.

    reduction = OverlappedReduction(model.parameters(), group, bucket_elements, is_boundary, compressor)
    ... loss.backward() ...    # buckets start on their own as their gradients are ready
    reduction.finish()         # the rest start, all are waited for, .grad holds the average

DeepSpeed's `overlap_comm` issues its reductions on an accelerator's side stream, which CPU
training does not have; with gloo its per-bucket reductions block the backward pass. Here every
parameter's gradient hook (after accumulation) marks it ready. The parameters are cut into
buckets of about `bucket_elements` in reverse order (the order backward produces them), and a
bucket whose gradients are all ready starts its collective asynchronously, once every earlier
bucket has started (collectives must start in the same order on every rank): an all-reduce of the
flat bucket, or, with a `GradientCompressor`, the all-gather of its compressed payloads. gloo and
NCCL run asynchronous collectives on their own threads and streams, so the link is busy while
backward computes. `finish` (called where the engine would all-reduce: at the end of the
accumulation step's last backward) starts what has not started (a parameter that got no gradient
counts as zeros, as DeepSpeed does) and writes the averages back.

Only the last micro-batch of an accumulation step (`is_boundary()` true during its backward)
reduces; the others accumulate locally. The compressor's error feedback is keyed by the
parameter's index in the model, as for the reduction without overlap, so checkpoints of the two
are interchangeable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .gradient_compression import GradientCompressor

# torch DistributedDataParallel's default bucket: 25 MiB of fp32 gradients.
DEFAULT_BUCKET_ELEMENTS = 25 * 2**20 // 4


@dataclass
class _Bucket:
    keys: list[int]
    params: list[nn.Parameter]
    waiting: int = 0  # gradients not yet ready in this backward pass
    flat: torch.Tensor | None = None
    handle: Any = None  # the collective under way (a Work, or the compressor's PendingAverage)

    @property
    def numels(self) -> list[int]:
        return [p.numel() for p in self.params]


@dataclass
class OverlappedReduction:
    """Averages the gradients of `parameters` over `group`, bucket by bucket during backward."""

    parameters: Iterable[nn.Parameter]
    group: dist.ProcessGroup | None
    bucket_elements: int
    is_boundary: Callable[[], bool]
    compressor: GradientCompressor | None = None
    buckets: list[_Bucket] = field(init=False)
    started: int = field(init=False, default=0)  # buckets started in this backward pass, in order

    def __post_init__(self) -> None:
        if self.bucket_elements < 1:
            raise ValueError(f"a gradient bucket holds at least one element; got {self.bucket_elements}")
        trained = [(i, p) for i, p in enumerate(self.parameters) if p.requires_grad and p.numel()]
        self.buckets = []
        for key, param in reversed(trained):
            if not self.buckets or sum(self.buckets[-1].numels) >= self.bucket_elements:
                self.buckets.append(_Bucket([], []))
            self.buckets[-1].keys.append(key)
            self.buckets[-1].params.append(param)
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._hook(bucket))

    def _hook(self, bucket: _Bucket) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            if not self.is_boundary():
                return
            bucket.waiting -= 1
            while self.started < len(self.buckets) and self.buckets[self.started].waiting == 0:
                self._start(self.buckets[self.started])

        return ready

    def _start(self, bucket: _Bucket) -> None:
        for param in bucket.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])  # type: ignore[union-attr]
        if self.compressor is not None:
            bucket.handle = self.compressor.start(flat, bucket.keys, bucket.numels, self.group)
        else:
            bucket.handle = dist.all_reduce(flat, group=self.group, async_op=True)
        bucket.flat = flat
        self.started += 1

    def finish(self) -> None:
        """Start the buckets backward left unstarted, wait for every bucket and write the averages
        into the parameters' .grad; ready for the next accumulation step."""
        while self.started < len(self.buckets):
            self._start(self.buckets[self.started])
        world_size = dist.get_world_size(self.group)
        for bucket in self.buckets:
            flat = bucket.flat
            assert flat is not None  # every bucket has started
            if self.compressor is not None:
                self.compressor.finish(bucket.handle)
            else:
                bucket.handle.wait()
                flat.div_(world_size)
            for param, averaged in zip(bucket.params, flat.split(bucket.numels)):
                param.grad.copy_(averaged.view_as(param))  # type: ignore[union-attr]
            bucket.flat, bucket.handle, bucket.waiting = None, None, len(bucket.params)
        self.started = 0
