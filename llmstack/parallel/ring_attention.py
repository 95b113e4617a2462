"""Ring attention over load-balanced sequence chunks, with its own backward.

Each rank of the group holds two chunks of the sequence (chunks r and 2N-1-r of 2N: see
llmstack.parallel.context_parallel) of q, k and v. In N steps every rank's keys and values pass
once round the ring; at each step a rank attends its query chunks to the key chunks it holds,
block by block, and merges the blocks by their log-sum-exp (online softmax). Per (query chunk,
key chunk) pair the causal mask is decided by the chunks' global places: a later key chunk is
skipped, an earlier one read whole, the same chunk read up to the diagonal; under document
masking a query reads only keys of its own document, by the whole sequence's document numbers.

The backward is written out (`_RingAttention`): it saves q, k, v, the output and the per-query
log-sum-exp only (memory linear in the sequence, as flash attention's), recomputes each block's
probabilities, and passes the key/value gradients round the ring with the keys and values, so
that after N steps each rank holds the gradients of its own keys and values. Blocks are computed
in fp32 (or the inputs' wider type) with plain matmuls (any device; a chunk pair's scores exist one at a time).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from llmstack.models.modeling_llmstack import document_mask

# A (query chunk, key chunk) pair's mask: None reads every key, a tensor is a boolean mask.
SKIP = "skip"


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's (batch, heads, seq/N, head_dim) q over the whole sequence's
    k and v, each rank holding its two load-balanced chunks; `document_ids` (batch, seq): the
    whole sequence's documents in natural order, or None."""
    return _RingAttention.apply(q, k, v, group, document_ids)


def _chunks(rank: int, size: int) -> tuple[int, int]:
    """The global chunk numbers a rank holds, in the order of its tokens."""
    return rank, 2 * size - 1 - rank


def _pair_mask(q_chunk: int, k_chunk: int, chunk: int, document_ids: torch.Tensor | None, device: torch.device) -> Any:
    """SKIP, None (every key) or the boolean (batch or 1, 1, chunk, chunk) mask of a chunk pair."""
    if k_chunk > q_chunk:
        return SKIP
    if document_ids is None:
        return None if k_chunk < q_chunk else torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    q_docs = document_ids[:, q_chunk * chunk : (q_chunk + 1) * chunk]
    if k_chunk == q_chunk:
        return document_mask(q_docs)
    k_docs = document_ids[:, k_chunk * chunk : (k_chunk + 1) * chunk]
    mask = (q_docs[:, :, None] == k_docs[:, None, :])[:, None]
    return mask if bool(mask.any()) else SKIP


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
    return scores if mask is None else scores.masked_fill_(~mask, -math.inf)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of q over one key block; rows with no key: output 0, lse -inf."""
    scores = _scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, v), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that read no key of a block) as 0, so that exp(-inf - lse) is 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (output, lse) into the running ones, in place (online softmax); rows that
    have read no key yet, in either, stay (0, -inf)."""
    merged = torch.logaddexp(lse, block_lse)
    scale = _finite(merged).unsqueeze(-1)
    out.mul_(torch.exp(lse.unsqueeze(-1) - scale)).add_(block_out * torch.exp(block_lse.unsqueeze(-1) - scale))
    lse.copy_(merged)


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group or dist.group.WORLD
        assert self.group is not None  # torch.distributed is initialized
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def pass_on(self, tensor: torch.Tensor, tag: int = 0) -> tuple[list[Any], torch.Tensor]:
        """Start sending `tensor` on and receiving the previous rank's (`tag`: which exchange)."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(pending: tuple[list[Any], torch.Tensor]) -> torch.Tensor:
        for request in pending[0]:
            request.wait()
        return pending[1]

    def blocks(
        self, step: int, chunk: int, document_ids: torch.Tensor | None, device: torch.device
    ) -> Iterator[tuple[slice, slice, torch.Tensor | None]]:
        """(query rows, key rows, mask) of each chunk pair to compute at `step`, when this rank
        holds the keys of rank - step."""
        source = (self.rank - step) % self.size
        for qi, q_chunk in enumerate(_chunks(self.rank, self.size)):
            for ki, k_chunk in enumerate(_chunks(source, self.size)):
                mask = _pair_mask(q_chunk, k_chunk, chunk, document_ids, device)
                if mask is not SKIP:
                    yield slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk), mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        ring, chunk = _Ring(group), q.shape[2] // 2
        dtype = torch.promote_types(q.dtype, torch.float32)
        qf, kv = q.to(dtype), torch.stack([k, v])
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], -math.inf, dtype=dtype, device=q.device)
        for step in range(ring.size):
            pending = ring.pass_on(kv) if step < ring.size - 1 else None
            for rows, keys, mask in ring.blocks(step, chunk, document_ids, q.device):
                kb, vb = kv[0, :, :, keys].to(dtype), kv[1, :, :, keys].to(dtype)
                _merge(out[:, :, rows], lse[:, :, rows], *_block_forward(qf[:, :, rows], kb, vb, mask))
            if pending is not None:
                kv = _Ring.wait(pending)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        ring, chunk, dtype = _Ring(ctx.group), q.shape[2] // 2, out.dtype
        qf, dout, kv = q.to(dtype), grad.to(dtype), torch.stack([k, v])
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O), the softmax backward's correction
        lse = _finite(lse).unsqueeze(-1)
        dq = torch.zeros_like(qf)
        dkv = torch.zeros(kv.shape, dtype=dtype, device=q.device)  # travels round the ring with kv
        scale = 1.0 / math.sqrt(q.shape[-1])
        for step in range(ring.size):
            pending = ring.pass_on(kv) if step < ring.size - 1 else None
            for rows, keys, mask in ring.blocks(step, chunk, document_ids, q.device):
                qb, kb, vb, dob = (
                    qf[:, :, rows],
                    kv[0, :, :, keys].to(dtype),
                    kv[1, :, :, keys].to(dtype),
                    dout[:, :, rows],
                )
                probs = torch.exp(_scores(qb, kb, mask) - lse[:, :, rows])
                dkv[1, :, :, keys] += torch.matmul(probs.transpose(-1, -2), dob)
                dscores = torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta[:, :, rows]).mul_(probs).mul_(scale)
                dq[:, :, rows] += torch.matmul(dscores, kb)
                dkv[0, :, :, keys] += torch.matmul(dscores.transpose(-1, -2), qb)
            # The gradients go on with their keys and values: after N passes each is back with its owner.
            dkv = _Ring.wait(ring.pass_on(dkv, tag=1))
            if pending is not None:
                kv = _Ring.wait(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
