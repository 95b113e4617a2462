"""Averaging gradients over the data-parallel ranks with compressed payloads and error feedback.

Two codecs, each applied to a flat fp32 gradient bucket:

    int8  blockwise quantization (as ZeRO++'s qgZ): blocks of INT8_BLOCK elements, each sent as
          int8 values and one fp32 scale (its absolute maximum / 127); about 1.02 bytes per element.
    topk  sparsification: the `fraction` of elements largest in magnitude, sent as fp32 values and
          int32 indices; 8 bytes per kept element.

Every rank compresses its bucket plus the residual it kept from earlier steps (error feedback: what
compression dropped is added back next time, so nothing is lost, only delayed), all-gathers the
compressed payloads and averages the decompressed ones locally. Every rank decompresses the same
payloads in the same order, so every rank ends with the same average. All-gather then local
reduction is what qgZ-like schemes do where the collective cannot reduce compressed values (gloo).

Residuals are kept per parameter (`keys`), so buckets may be formed differently between calls.

The first `warmup_steps` optimizer steps average densely (a plain all-reduce, no residuals), as
Deep Gradient Compression does: the early steps, where the gradients change fastest, are the ones
top-k's delay hurts most.

After the warm-up top-k delivers each element in bursts (zero for n - 1 steps, then about n steps'
gradient at once); `normalize_bursts` asks for AdamW that takes a burst as n steps' energy
(burst_adamw.BurstAdamW), which deepspeed_integration puts in place of the ds_config's AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmstack.errors import UserError

from .compressed_allreduce import allreduce_bytes

METHODS = ("none", "int8", "topk")
SPEC_KEYS = ("method", "topk_fraction", "warmup_steps", "normalize_bursts")  # of a ds_config's "gradient_compression"
# ZeRO 1/2 settings under which each gradient bucket is all-reduced whole, by the call replaced.
ZERO_SETTINGS = {"reduce_scatter": False, "contiguous_gradients": True}
# Dense steps before top-k starts: a third of the 300-step convergence bench run. With 60 (after
# the learning-rate warm-up, as 1-bit Adam's freeze_step) top-k 1% ended 1.05-1.06x uncompressed's
# loss there, with 100 1.015-1.019x (BurstAdamW, seeds 0-2).
TOPK_WARMUP_STEPS = 100
# topk_indices: tensors from this size are selected from candidates above a sampled threshold
SAMPLED_SELECTION_MIN = 1 << 16
SELECTION_SAMPLE = 8192
INT8_BLOCK = 256
INT8_MAX = 127


def quantize_int8(x: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per block) of flat `x`, zero-padded to whole blocks."""
    blocks = _blocks(x, block)
    scales = blocks.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / safe.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.view(-1), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 tensor of `numel` elements that `quantize_int8` encoded."""
    blocks = values.view(scales.numel(), -1).to(torch.float32) * scales.unsqueeze(1)
    return blocks.view(-1)[:numel]


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest of flat `scores` (the set torch.topk selects; no order), faster
    on large tensors: the elements above a threshold estimated from a strided sample (about 2k of
    them) are the candidates, and the exact top k is taken among those. Where the sample's estimate
    leaves fewer than k candidates, torch.topk over all."""
    numel = scores.numel()
    if numel < SAMPLED_SELECTION_MIN or k > numel // 8:
        return torch.topk(scores, k, sorted=False).indices
    sample = scores[:: numel // SELECTION_SAMPLE]
    threshold = torch.quantile(sample, 1 - 2 * k / numel)
    candidates = (scores >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return torch.topk(scores, k, sorted=False).indices
    return candidates[torch.topk(scores[candidates], k, sorted=False).indices]


def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) of the `k` elements of flat `x` largest in magnitude."""
    indices = topk_indices(x.abs(), k)
    return x[indices], indices.to(torch.int32)


def topk_scatter(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """The dense fp32 tensor of `numel` elements, zero except `values` at `indices` (summed where
    indices repeat, as when several ranks' selections are scattered at once)."""
    dense = torch.zeros(numel, dtype=torch.float32, device=values.device)
    return dense.index_add_(0, indices.long().view(-1), values.view(-1).to(torch.float32))


def topk_count(numel: int, fraction: float) -> int:
    """Elements top-k keeps of `numel`: ceil(fraction * numel), at least 1."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def payload_bytes(method: str, numel: int, fraction: float = 0.01) -> int:
    """Bytes of one rank's compressed payload for a bucket of `numel` elements."""
    if method == "int8":
        blocks = -(-numel // INT8_BLOCK)
        return blocks * INT8_BLOCK + 4 * blocks
    if method == "topk":
        return 8 * topk_count(numel, fraction)
    raise ValueError(f"no payload for method {method!r}")


def zero_settings_for_compression(zero: dict[str, Any]) -> dict[str, Any]:
    """A ds_config's zero_optimization section with ZERO_SETTINGS at stages 1 and 2; one that sets
    another value explicitly is a UserError (checked before start-up by the run config, too)."""
    if zero.get("stage", 0) not in (1, 2):
        return zero
    for key, value in ZERO_SETTINGS.items():
        if zero.get(key, value) != value:
            raise UserError(
                f"gradient compression replaces ZeRO's whole-bucket all-reduce, which needs "
                f"zero_optimization.{key}={str(value).lower()}: remove {key} from the ds_config"
            )
    return {**zero, **ZERO_SETTINGS}


def compressor_from_spec(spec: Any) -> GradientCompressor | None:
    """The compressor a ds_config's "gradient_compression" entry asks for (None for method "none"),
    with its defaults: topk_fraction 0.01, and for topk warmup_steps TOPK_WARMUP_STEPS and
    normalize_bursts true. A UserError names what is wrong with the entry."""
    if not isinstance(spec, dict) or set(spec) - set(SPEC_KEYS):
        raise UserError(
            f'ds_config "gradient_compression" must be an object with keys {", ".join(SPEC_KEYS)}; got {spec!r}'
        )
    method = spec.get("method", "none")
    if method not in METHODS:
        raise UserError(f"gradient compression method must be one of {', '.join(METHODS)}; got {method!r}")
    if method == "none":
        return None
    fraction = spec.get("topk_fraction", 0.01)
    if not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise UserError(f"gradient compression topk_fraction must lie in (0, 1], e.g. 0.01; got {fraction!r}")
    warmup_steps = spec.get("warmup_steps", TOPK_WARMUP_STEPS if method == "topk" else 0)
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise UserError(
            f"gradient compression warmup_steps must be a whole number of at least 0 (steps averaged "
            f"uncompressed before top-k starts; default {TOPK_WARMUP_STEPS}); got {warmup_steps!r}"
        )
    if method != "topk" and warmup_steps:
        raise UserError(f"gradient compression warmup_steps applies to topk only; remove it for {method}")
    normalize_bursts = spec.get("normalize_bursts", method == "topk")
    if not isinstance(normalize_bursts, bool) or (normalize_bursts and method != "topk"):
        raise UserError(
            f"gradient compression normalize_bursts must be true or false, and applies to topk only; "
            f"got {normalize_bursts!r} for {method}"
        )
    return GradientCompressor(method, float(fraction), warmup_steps, normalize_bursts)


@dataclass
class PendingAverage:
    """A compressed average under way: the bucket it will overwrite, the buffer the ranks'
    payloads arrive in (None in the warm-up: the bucket is all-reduced in place), the collective's
    handle (None once it has completed) and the group's size."""

    flat: torch.Tensor
    gathered: torch.Tensor | None
    work: Any
    world_size: int


class GradientCompressor:
    """Averages flat gradient buckets over a process group with one codec and error feedback.

    `bytes_sent` counts what this rank put on the wire (ring all-gather: (W-1) payloads per call)
    since the last `reset_bytes`. `steps_done` returns the optimizer steps taken so far (the
    engine's count, set by deepspeed_integration.configure_engine): buckets are averaged densely
    while it is below `warmup_steps`. `normalize_bursts`: the optimizer should be BurstAdamW
    (`delivers_bursts` says whether it applies: top-k below a full selection).
    """

    def __init__(
        self, method: str, topk_fraction: float = 0.01, warmup_steps: int = 0, normalize_bursts: bool = False
    ) -> None:
        if method not in METHODS[1:]:
            raise ValueError(f"method must be one of {', '.join(METHODS[1:])}; got {method!r}")
        if not 0.0 < topk_fraction <= 1.0:
            raise ValueError(f"topk_fraction must lie in (0, 1]; got {topk_fraction}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be at least 0; got {warmup_steps}")
        self.method = method
        self.topk_fraction = topk_fraction
        self.warmup_steps = warmup_steps
        self.normalize_bursts = normalize_bursts
        self.steps_done: Callable[[], int] = lambda: 0
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.bytes_sent = 0

    def settings(self) -> dict[str, Any]:
        """The "gradient_compression" entry this compressor was built from, defaults included."""
        return {
            "method": self.method,
            "topk_fraction": self.topk_fraction,
            "warmup_steps": self.warmup_steps,
            "normalize_bursts": self.normalize_bursts,
        }

    @property
    def delivers_bursts(self) -> bool:
        """Whether AdamW behind this compressor should be BurstAdamW: top-k that drops elements,
        with normalize_bursts. At a full selection every element arrives every step."""
        return self.normalize_bursts and self.method == "topk" and self.topk_fraction < 1.0

    def average(
        self, flat: torch.Tensor, keys: Sequence[Hashable], numels: Sequence[int], group: dist.ProcessGroup | None
    ) -> None:
        """Replace `flat` (the concatenation of the gradients named `keys`, of `numels` elements)
        by its average over `group`, in place."""
        self.finish(self.start(flat, keys, numels, group, async_op=False))

    def start(
        self,
        flat: torch.Tensor,
        keys: Sequence[Hashable],
        numels: Sequence[int],
        group: dist.ProcessGroup | None,
        async_op: bool = True,
    ) -> PendingAverage:
        """`average`'s first half: compress `flat` (error feedback updated) and start the all-gather
        of the payloads, by default without waiting for it; `finish` writes the average into `flat`."""
        if sum(numels) != flat.numel():
            raise ValueError(f"the keys' {sum(numels)} elements do not make up the bucket's {flat.numel()}")
        world_size = dist.get_world_size(group)
        if self.steps_done() < self.warmup_steps:
            self.bytes_sent += allreduce_bytes(flat.numel(), flat.element_size(), world_size)
            return PendingAverage(flat, None, dist.all_reduce(flat, group=group, async_op=async_op), world_size)
        x = flat.to(torch.float32) + self._residual(keys, numels, flat.device)
        payload, kept = self._compress(x)
        self._keep_residual(x.sub_(kept), keys, numels)
        gathered = torch.empty(world_size, payload.numel(), dtype=payload.dtype, device=payload.device)
        work = dist.all_gather(list(gathered.unbind(0)), payload, group=group, async_op=async_op)
        self.bytes_sent += (world_size - 1) * payload.nbytes
        return PendingAverage(flat, gathered, work, world_size)

    def finish(self, pending: PendingAverage) -> None:
        """Wait for `start`'s all-gather and replace its bucket by the average, in place."""
        if pending.work is not None:
            pending.work.wait()
        if pending.gathered is None:
            pending.flat.div_(pending.world_size)
            return
        total = self._decompress_sum(pending.gathered, pending.flat.numel())
        pending.flat.copy_(total.div_(pending.world_size))

    def _compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload as one int32/uint8 tensor, what the payload decodes to)."""
        if self.method == "int8":
            values, scales = quantize_int8(x)
            payload = torch.cat([values.view(torch.uint8), scales.view(torch.uint8)])
            return payload, dequantize_int8(values, scales, x.numel())
        values, indices = topk_select(x, topk_count(x.numel(), self.topk_fraction))
        return torch.cat([values.view(torch.int32), indices]), topk_scatter(values, indices, x.numel())

    def _decompress_sum(self, gathered: torch.Tensor, numel: int) -> torch.Tensor:
        """The sum of every rank's decoded payload (rows of `gathered`), added in rank order."""
        if self.method == "int8":
            padded = gathered.shape[1] * INT8_BLOCK // (INT8_BLOCK + 4)
            values = gathered[:, :padded].contiguous().view(torch.int8)
            scales = gathered[:, padded:].contiguous().view(torch.float32)
            total = torch.zeros(numel, dtype=torch.float32, device=gathered.device)
            for rank_values, rank_scales in zip(values, scales):
                total.add_(dequantize_int8(rank_values, rank_scales, numel))
            return total
        k = gathered.shape[1] // 2
        return topk_scatter(gathered[:, :k].contiguous().view(torch.float32), gathered[:, k:], numel)

    def _residual(self, keys: Sequence[Hashable], numels: Sequence[int], device: torch.device) -> torch.Tensor:
        parts = [self.residuals.get(key, torch.zeros(n, device=device)) for key, n in zip(keys, numels)]
        return torch.cat(parts)

    def _keep_residual(self, residual: torch.Tensor, keys: Sequence[Hashable], numels: Sequence[int]) -> None:
        for key, part in zip(keys, residual.split(list(numels))):
            self.residuals[key] = part.clone()

    def reset_bytes(self) -> None:
        self.bytes_sent = 0

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "topk_fraction": self.topk_fraction, "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["method"] != self.method:
            raise ValueError(f"the saved error feedback is for {state['method']}, not {self.method}")
        self.residuals = dict(state["residuals"])


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flat `x` as (blocks, block) fp32, zero-padded."""
    flat = x.reshape(-1).to(torch.float32)
    padding = -flat.numel() % block
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(-1, block)
