"""Averaging tensors over a process group, in full precision or compressed to 1 bit per element.

`compressed_allreduce` is the two-phase scheme of 1-bit Adam (Tang et al., 2021). Every rank
compresses each tensor to its signs plus one scale (with error feedback); an all-to-all hands rank
r the r-th slice of every tensor from every rank; rank r averages its slices and compresses the
average again (with its own, server-side error feedback); an all-gather returns every averaged
slice to every rank. A rank sends about 2 bits per element instead of the 64 of a ring all-reduce
in fp32.

Each tensor keeps its own scale, as in DeepSpeed's original implementation (one scale for a whole
model would drown the small tensors in the large ones' noise), yet all tensors travel in one
all-to-all and one all-gather: the tensors are laid out as a (world size, width) matrix whose row r
holds the r-th slice of each tensor, so row r is exactly what rank r serves.

Built on torch.distributed alone, so it runs on gloo and NCCL. Every function returns the number
of bytes this rank sent, counted from the tensors handed to the collectives (ring algorithms).
"""

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

SCALE_DTYPE = torch.float32


def allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` elements: 2 (W-1)/W of the tensor."""
    return 2 * (world_size - 1) * numel * element_size // world_size


def allreduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Average `tensor` in place over `group`; returns the bytes this rank sent."""
    world_size = dist.get_world_size(group)
    dist.all_reduce(tensor, group=group)
    tensor.div_(world_size)
    return allreduce_bytes(tensor.numel(), tensor.element_size(), world_size)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of `x` (numel a multiple of 8), set where x >= 0.

    Returns uint8 of numel/8 elements, most significant bit first (numpy.packbits' order). Each 8
    booleans are read as one little-endian int64 whose bytes are 0 or 1; multiplying by
    _PACK_MULTIPLIER moves byte i's bit to bit 63 - i with no two partial products on the same bit
    (so no carries), and the top byte is the packed one.
    """
    bits = (x.reshape(-1, 8) >= 0).view(torch.int64)
    return (bits.mul_(_PACK_MULTIPLIER) >> 56).to(torch.uint8).view(-1)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `pack_signs` along the last dimension: +1 for a set bit, -1 otherwise."""
    signs = _sign_table(packed.device, dtype).index_select(0, packed.reshape(-1).int())
    return signs.view(*packed.shape[:-1], 8 * packed.shape[-1])


# 0x8040201008040201 as a signed int64 (the product wraps modulo 2**64 either way).
_PACK_MULTIPLIER = 0x8040201008040201 - 2**64


@functools.cache
def _sign_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 8): row b holds the signs (+1, -1) of byte b's bits, most significant first."""
    bits = (torch.arange(256, device=device).unsqueeze(-1) >> torch.arange(7, -1, -1, device=device)) & 1
    return bits.to(dtype).mul_(2).sub_(1)


class SliceLayout:
    """Where each of a list of tensors lies in the (world size, width) matrix that is exchanged.

    Tensor i takes `widths[i]` consecutive columns, a multiple of 8 so that its signs pack into
    whole bytes; its elements fill those columns row after row, zero-padded at the end.
    """

    def __init__(self, numels: Sequence[int], world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.numels = list(numels)
        self.widths = [-(-n // (8 * world_size)) * 8 for n in self.numels]
        self.width = sum(self.widths)
        widths = torch.tensor(self.widths, device=device)
        self.segment_ids = torch.repeat_interleave(torch.arange(len(self.numels), device=device), widths)
        self.column_counts = widths.to(SCALE_DTYPE)

    def rows(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensors as one fp32 (world size, width) matrix."""
        rows = torch.zeros(self.world_size, self.width, dtype=torch.float32, device=self.segment_ids.device)
        for tensor, block, numel in zip(tensors, rows.split(self.widths, dim=1), self.numels):
            width = block.shape[1]
            full, rest = divmod(numel, width)
            flat = tensor.reshape(-1)
            block[:full].copy_(flat[: full * width].view(full, width))
            if rest:
                block[full, :rest].copy_(flat[full * width :])
        return rows

    def scatter(self, rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy a (world size, width) matrix back into the tensors."""
        for tensor, block, numel in zip(tensors, rows.split(self.widths, dim=1), self.numels):
            tensor.copy_(block.reshape(-1)[:numel].view_as(tensor))


def slice_layout(tensors: Sequence[torch.Tensor], world_size: int) -> SliceLayout:
    """The SliceLayout of `tensors` (built once per model and world size, not per call)."""
    return _cached_layout(tuple(t.numel() for t in tensors), world_size, tensors[0].device)


@functools.lru_cache(maxsize=8)
def _cached_layout(numels: tuple[int, ...], world_size: int, device: torch.device) -> SliceLayout:
    return SliceLayout(numels, world_size, device)


def compress(x: torch.Tensor, error: torch.Tensor, layout: SliceLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of `x + error`, one scale per tensor of `layout`, with error feedback.

    `x` is (rows, layout.width). Adds `error` into `x`, approximates each tensor's part by
    scale * sign(x) with scale = its RMS (||x||_2 / sqrt(n), as in the 1-bit Adam paper), and
    leaves the approximation error in `error` for the next call. Returns (packed signs of shape
    (rows, width / 8), the scales).
    """
    x.add_(error)
    norms = torch.stack([torch.linalg.vector_norm(block) for block in x.split(layout.widths, dim=1)])
    scales = norms / (layout.column_counts * x.shape[0]).sqrt()
    signs = pack_signs(x).view(x.shape[0], -1)
    torch.sub(x, decompress(signs, scales, layout), out=error)
    return signs, scales


def decompress(signs: torch.Tensor, scales: torch.Tensor, layout: SliceLayout) -> torch.Tensor:
    """scale * sign for packed `signs` (rows, width / 8) and per-tensor `scales`: (tensors,) for
    all rows or (rows, tensors)."""
    return unpack_signs(signs, SCALE_DTYPE).mul_(scales[..., layout.segment_ids])


def error_feedback_buffers(layout: SliceLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero (worker, server) error-feedback buffers for `compressed_allreduce` with `layout`."""
    device = layout.segment_ids.device
    worker = torch.zeros(layout.world_size, layout.width, dtype=SCALE_DTYPE, device=device)
    server = torch.zeros(1, layout.width, dtype=SCALE_DTYPE, device=device)
    return worker, server


def compressed_allreduce(
    tensors: Sequence[torch.Tensor],
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Average each of `tensors` over `group` in place, exchanging 1-bit compressed slices.

    `worker_error` and `server_error` (from `error_feedback_buffers`) carry each side's
    compression error from one call to the next and must persist across calls with the same
    tensors. Every rank ends with the same values. Returns the bytes this rank sent.
    """
    layout = slice_layout(tensors, dist.get_world_size(group))
    average, sent = compressed_reduce_scatter(layout.rows(tensors), worker_error, layout, group)
    rows, gathered = compressed_all_gather(average, server_error, layout, group)
    layout.scatter(rows, tensors)
    return sent + gathered


def compressed_reduce_scatter(
    rows: torch.Tensor, worker_error: torch.Tensor, layout: SliceLayout, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Phase 1: (the average over `group` of row r of every rank's `rows`, as (1, width); bytes
    sent) on rank r. `rows` (world size, width) is compressed with `worker_error` and overwritten."""
    world_size = dist.get_world_size(group)
    if worker_error.shape != (world_size, layout.width):
        raise ValueError(f"worker_error has shape {tuple(worker_error.shape)}; expected ({world_size}, {layout.width})")
    # Row r (the r-th slice of every tensor) goes to rank r.
    signs, scales = compress(rows, worker_error, layout)
    send = torch.cat([signs, _as_bytes(scales).expand(world_size, -1)], dim=1)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return _decompress_rows(received, layout).mean(dim=0, keepdim=True), send.nbytes * (world_size - 1) // world_size


def compressed_all_gather(
    row: torch.Tensor, server_error: torch.Tensor, layout: SliceLayout, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Phase 2: (every rank's `row` (1, width), compressed with `server_error`, as the (world size,
    width) matrix every rank receives; bytes sent). `row` is overwritten."""
    world_size = dist.get_world_size(group)
    signs, scales = compress(row, server_error, layout)
    send = torch.cat([signs.view(-1), _as_bytes(scales)])
    gathered = torch.empty(world_size, send.numel(), dtype=torch.uint8, device=send.device)
    dist.all_gather(list(gathered.unbind(0)), send, group=group)
    return _decompress_rows(gathered, layout), send.nbytes * (world_size - 1)


def _as_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.to(SCALE_DTYPE).view(torch.uint8)


def _decompress_rows(received: torch.Tensor, layout: SliceLayout) -> torch.Tensor:
    """Decompress received uint8 rows, each the packed signs followed by its sender's scales."""
    signs_bytes = layout.width // 8
    scales = received[:, signs_bytes:].contiguous().view(SCALE_DTYPE)
    return decompress(received[:, :signs_bytes], scales, layout)
