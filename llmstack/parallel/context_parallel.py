"""Context parallelism: each sequence split over the ranks of a context-parallel group.

    context_parallelize(model, group, method="ulysses")   # after tensor parallelism, if any
    loss = model(**shard_sequence(inputs, group), num_items_in_batch=...).loss

Every rank of a context-parallel group reads the same samples; `shard_sequence` keeps this rank's
tokens of each (inputs, shifted targets, positions, documents). Targets are shifted before the
split, so no target is lost at a chunk boundary, and each rank's loss covers its own tokens.

Causal load balancing: a sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r, a
head and a tail, so that every rank computes the same share of the causal attention (rank 0's
head chunk reads few keys, its tail chunk nearly all). Positions (RoPE) are global: a rank's
tokens get their place in the whole sequence (or in their document, under document masking).

Everything but attention is per token and runs on the rank's tokens as it would on the whole
sequence. Attention (each layer's `Attention.core`) is replaced by one of two methods:

    ulysses   all-to-all from sequence-split to head-split q, k, v; each rank attends its 1/N of
              the heads over the whole sequence with the dense kernel; all-to-all back. Needs the
              attention heads (per tensor-parallel rank) divisible by N. The default: two
              all-to-alls of 1/N of the activations per layer, and the fused attention kernel.
    ring      key/value chunks passed round the ring, blockwise attention with online softmax
              (llmstack.parallel.ring_attention). Any head count (also key/value heads < N).

The loss divided by the global target count (`num_items_in_batch`, the trainer's) and the
gradients of the replicated weights summed over the group (DeepSpeed counts the context ranks as
data-parallel ranks: llmstack.parallel.topology) give the gradient of the whole sequence's loss.

A forward pre-hook on the model gathers the documents of the whole sequence for the attention
(document masking: a query reads the earlier keys of its own document, on any rank) and takes
them out of the model's arguments, so the body builds no mask over its own tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmstack.compat.deepspeed import full_shape
from llmstack.errors import UserError
from llmstack.models.configuration_llmstack import LLMStackConfig
from llmstack.models.modeling_llmstack import Attention, document_mask

from .layout import CONTEXT_METHODS, check_context_heads
from .ring_attention import ring_attention

SEQUENCE_KEYS = ("input_ids", "shift_labels", "position_ids", "document_ids")


def chunk_indices(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token indices of `rank`'s share of a sequence: chunks rank and 2*size-1-rank of 2*size."""
    if seq_len % (2 * size):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {size} equal chunks")
    chunk = seq_len // (2 * size)
    starts = (rank * chunk, (2 * size - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def ring_order(seq_len: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token indices of the group's shares concatenated in rank order."""
    return torch.cat([chunk_indices(seq_len, size, r, device) for r in range(size)])


def shard_sequence(inputs: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """This rank's tokens of a packed batch {"input_ids", "shift_labels", and for document masking
    "position_ids", "document_ids"} (batch, seq): its chunks of each, with its global positions
    when none are given. Targets must be shifted already ("labels" would lose the next token at
    each chunk's end)."""
    if "labels" in inputs:
        raise ValueError("context parallelism splits packed blocks with shifted targets (shift_labels), not labels")
    input_ids = inputs["input_ids"]
    index = chunk_indices(input_ids.shape[1], dist.get_world_size(group), dist.get_rank(group), input_ids.device)
    sharded = {k: (v[:, index] if k in SEQUENCE_KEYS and v is not None else v) for k, v in inputs.items()}
    if sharded.get("position_ids") is None:
        sharded["position_ids"] = index.unsqueeze(0)
    return sharded


@dataclass
class SequenceShare:
    """What the attention of one forward pass needs beyond q, k and v: the group, and the
    documents of the whole sequence in natural order (None: one causal sequence)."""

    group: dist.ProcessGroup | None
    document_ids: torch.Tensor | None = field(default=None)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def gather_documents(self, local: torch.Tensor | None) -> None:
        """Keep the whole sequence's document numbers, from every rank's share of them."""
        if local is None:
            self.document_ids = None
            return
        shares = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(shares, local.contiguous(), group=self.group)
        in_ring_order = torch.cat(shares, dim=1)
        natural = torch.empty_like(in_ring_order)
        natural[:, ring_order(natural.shape[1], self.size, local.device)] = in_ring_order
        self.document_ids = natural


class ContextParallelAttention:
    """An attention core with SDPA's signature over this rank's share of each sequence (see
    `SequenceShare`): whole causal sequences only, the documents taken from the share."""

    def __init__(self, share: SequenceShare) -> None:
        self.share = share

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or not is_causal:
            raise ValueError(
                "context-parallel attention computes whole causal sequences: no padding mask, KV cache or "
                "sliding window (documents come from the model's document_ids)"
            )
        return self.attend(q, k, v, dropout_p)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        raise NotImplementedError


class UlyssesAttention(ContextParallelAttention):
    """Attention over the whole sequence for 1/N of the heads, between two all-to-alls."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        group = self.share.group
        q, k, v = (_UlyssesExchange.apply(t, group, True) for t in (q, k, v))
        docs = self.share.document_ids
        if docs is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs), dropout_p=dropout_p)
        return _UlyssesExchange.apply(y, group, False)


class RingAttention(ContextParallelAttention):
    """Attention of this rank's queries over the whole sequence's keys, passed round the ring."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        if dropout_p:
            raise ValueError("ring attention runs without attention dropout")
        return ring_attention(q, k, v, self.share.group, self.share.document_ids)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Ulysses' first all-to-all: this rank's share of the sequence for every head, (batch, heads,
    tokens / N, dim), becomes the whole sequence in natural order for this rank's 1/N of the heads.

    Rank i's share arrives as its two chunks (i and 2N-1-i), copied straight to their places: one
    send buffer, one receive buffer and the result, no concatenated or reordered intermediates
    (at long sequence these copies, not the attention, set the layer's peak memory)."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=1))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    del send
    batch, heads, local, dim = received.shape[1:]
    out = received.new_empty(batch, heads, local * size, dim)
    for i, (head, tail) in enumerate(_chunk_slices(local, size)):
        out[:, :, head], out[:, :, tail] = received[i].chunk(2, dim=2)
    return out


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: the whole sequence for 1/N of the heads back to this
    rank's share of the sequence for every head, (batch, heads, tokens / N, dim)."""
    size = dist.get_world_size(group)
    batch, heads, seq, dim = x.shape
    local = seq // size
    send = x.new_empty(size, batch, heads, local, dim)
    for i, (head, tail) in enumerate(_chunk_slices(local, size)):
        torch.cat([x[:, :, head], x[:, :, tail]], dim=2, out=send[i])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    del send
    # Laid out (batch, tokens, heads, dim), as the output projection reads it: no copy there.
    out = received.new_empty(batch, local, heads * size, dim)
    for i, piece in enumerate(received):
        out[:, :, i * heads : (i + 1) * heads] = piece.transpose(1, 2)
    return out.transpose(1, 2)


def _chunk_slices(local: int, size: int) -> list[tuple[slice, slice]]:
    """Per rank, the natural-order slices of its head and tail chunks (see `chunk_indices`)."""
    chunk = local // 2
    return [
        (slice(i * chunk, (i + 1) * chunk), slice((2 * size - 1 - i) * chunk, (2 * size - i) * chunk))
        for i in range(size)
    ]


class _UlyssesExchange(torch.autograd.Function):
    """`sequence_to_heads` (to_heads) or `heads_to_sequence`; the backward is the other one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (sequence_to_heads if to_heads else heads_to_sequence)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (heads_to_sequence if ctx.to_heads else sequence_to_heads)(grad, ctx.group), None, None


def check_context_parallel_size(config: LLMStackConfig, size: int, method: str, tensor_parallel_size: int = 1) -> None:
    """Raise UserError unless `method` can split this model's attention over `size` ranks."""
    if method not in CONTEXT_METHODS:
        raise UserError(f"train.context_parallel_method must be one of {', '.join(CONTEXT_METHODS)}; got {method!r}")
    check_context_heads(config.num_attention_heads, size, method, tensor_parallel_size)
    if method == "ring" and config.attention_dropout:
        raise UserError("ring attention runs without attention dropout: set model.attention_dropout 0, or use ulysses")


def context_parallelize(model: nn.Module, group: dist.ProcessGroup | None, method: str = "ulysses") -> nn.Module:
    """Make `model` (a decoder taking `shard_sequence`'s inputs) compute its rank's share of each
    sequence over `group`, in place: every attention layer's core replaced by `method`'s, and a
    forward pre-hook gathering the sequence's documents."""
    config = model.config
    assert isinstance(config, LLMStackConfig)
    check_context_parallel_size(config, dist.get_world_size(group), method, _tensor_parallel_size(model, config))
    share = SequenceShare(group)
    core = UlyssesAttention(share) if method == "ulysses" else RingAttention(share)
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = core

    def documents_to_attention(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        share.gather_documents(bound.arguments.pop("document_ids", None))
        if bound.arguments.get("position_ids") is None:
            raise ValueError("a context-parallel model takes global position_ids (see shard_sequence)")
        return bound.args, bound.kwargs

    model.register_forward_pre_hook(documents_to_attention, with_kwargs=True)
    return model


def _tensor_parallel_size(model: nn.Module, config: LLMStackConfig) -> int:
    """How many tensor-parallel ranks share the heads: the split q projection's share of them."""
    attention = next(m for m in model.modules() if isinstance(m, Attention))
    return config.num_attention_heads * attention.head_dim // full_shape(cast(nn.Parameter, attention.q_proj.weight))[0]
