"""Per-rank memory of a DeepSpeed engine's training state, counted from the tensors the rank holds.

Four kinds, each byte counted once even where tensors share storage (ZeRO keeps parameters and
gradients as views into flat buffers), in this order of precedence:

- parameters: the weights the model computes with. Every parameter under ZeRO 0-2; under ZeRO-3
  this rank's partitions (`param.ds_tensor`) plus any parameter gathered at the moment.
- master_weights: the optimizer's own copies of the weights, i.e. what its param groups hold
  beyond the parameters: the fp32 masters of mixed precision, ZeRO's fp32 partitions. None for
  plain fp32 at ZeRO-0, where the optimizer updates the parameters themselves.
- gradients: what the engine and its optimizer hold as gradients (`.grad` of parameters and
  masters, ZeRO's reduced gradient partitions). Call between backward() and step() to see them
  at their peak; most are freed by step().
- optimizer_state: the optimizer's `state` (Adam's moments, 1-bit Adam's error feedback).

ZeRO's communication buckets (sized by reduce_bucket_size / allgather_bucket_size) are not counted.
"""

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from llmstack.compat.deepspeed import zero3_parameter_partitions, zero_state_tensors


def zero_memory_report(engine: Any) -> dict[str, int]:
    """{"parameters", "master_weights", "gradients", "optimizer_state": bytes held by this rank,
    "on_cpu": how many of those bytes are in CPU memory}."""
    counter = ByteCounter()
    optimizer = engine.basic_optimizer
    params = list(engine.module.parameters())
    zero_masters, zero_gradients = zero_state_tensors(engine.optimizer)
    masters = [p for group in optimizer.param_groups for p in group["params"]] + tensors_in(zero_masters)
    gradients = [p.grad for p in params + masters] + tensors_in(zero_gradients)
    return {
        "parameters": counter.add([p.data for p in params] + zero3_parameter_partitions(engine.optimizer, params)),
        "master_weights": counter.add(masters),
        "gradients": counter.add(gradients),
        "optimizer_state": counter.add(tensors_in(list(optimizer.state.values()))),
        "on_cpu": counter.cpu_bytes,
    }


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


class ByteCounter:
    """Counts the bytes of tensors, each byte of a storage once however many tensors view it."""

    def __init__(self) -> None:
        # (device, storage address) -> [(start, end)] byte spans counted
        self.spans: defaultdict[tuple[torch.device, int], list[tuple[int, int]]] = defaultdict(list)
        self.cpu_bytes = 0

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Count `tensors` (None entries are skipped); returns the bytes not counted before."""
        new = 0
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            start = int(t.storage_offset()) * t.element_size()
            key = (t.device, t.untyped_storage().data_ptr())
            added = _add_span(self.spans[key], start, start + t.numel() * t.element_size())
            new += added
            if t.device.type == "cpu":
                self.cpu_bytes += added
        return new


def _add_span(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """Merge [start, end) into the disjoint sorted `spans`; returns how many bytes were new."""
    covered = 0
    merged_start, merged_end = start, end
    kept = []
    for s, e in spans:
        if e < start or s > end:
            kept.append((s, e))
        else:
            covered += min(e, end) - max(s, start)
            merged_start, merged_end = min(merged_start, s), max(merged_end, e)
    kept.append((merged_start, merged_end))
    spans[:] = sorted(kept)
    return end - start - covered
