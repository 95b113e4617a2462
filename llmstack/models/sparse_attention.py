"""BigBird-style block-sparse attention: a local window, global blocks and random blocks.

The sequence is cut into blocks of `block_size` tokens; query block i attends to key blocks

- window: i-w .. i+w (causal: i-w .. i), w = `window_blocks`;
- global: the first `global_blocks` blocks. Bidirectional: every query reads them, and their own
  queries read the whole sequence (BigBird's ITC form, with the global blocks at the start).
  Causal: every query reads them (they act as an always-visible prefix, like attention sinks);
  their own queries read only their causal prefix, which lies inside them, so in a decoder
  "global" means read by all, not reading all;
- random: `random_blocks` more blocks, drawn once per (seed, layer, query block) from the blocks
  not already attended. Causal: only from blocks before the window, so a block's draw does not
  depend on the sequence length and decoding with a KV cache sees the keys a full forward sees.

Within those blocks a causal query reads keys at or before its own position. `sparse_attention`
computes this blockwise: each query block's key blocks are gathered into a compact key tensor,
so time and memory grow linearly with the sequence length. `BigBirdPattern.dense_mask` is the
same pattern as a boolean (seq, seq) mask, for dense attention (the reference the tests compare
with) and for the few new tokens of a decode step (`decoder_sparse_attention`). The masked-LM
encoder runs the bidirectional pattern through `encoder_sparse_attention`.
"""

import functools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .configuration_llmstack import LLMStackConfig


@dataclass(frozen=True)
class BigBirdPattern:
    block_size: int
    window_blocks: int
    global_blocks: int
    random_blocks: int = 0
    causal: bool = True
    seed: int = 0
    layer: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"sparse_block_size must be at least 1; got {self.block_size}")
        for name in ("window_blocks", "global_blocks", "random_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"sparse_{name} must be 0 or more; got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config: "LLMStackConfig", layer_idx: int) -> "BigBirdPattern":
        """The pattern of layer `layer_idx` (its own random blocks): causal in a decoder,
        bidirectional in an encoder (`config.causal` False)."""
        return cls(
            config.sparse_block_size,
            config.sparse_window_blocks,
            config.sparse_global_blocks,
            config.sparse_random_blocks,
            causal=config.causal,
            seed=config.sparse_seed,
            layer=layer_idx,
        )

    def num_blocks(self, seq_len: int) -> int:
        return -(-seq_len // self.block_size)

    def block_layout(self, num_blocks: int) -> torch.Tensor:
        """(num_blocks, num_blocks) boolean: whether query block i reads key block j."""
        return _block_layout(self, num_blocks).clone()

    def token_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """(..., q, k) boolean: whether a query at position q_pos[..., q] reads the key at k_pos[..., k].
        Positions are token indices (>= 0) below num_blocks * block_size."""
        layout = _block_layout(self, num_blocks).to(q_pos.device)
        q_pos, k_pos = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
        mask = layout[q_pos // self.block_size, k_pos // self.block_size]
        return mask & (k_pos <= q_pos) if self.causal else mask

    def dense_mask(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(seq_len, seq_len) boolean mask of the pattern, for dense attention."""
        pos = torch.arange(seq_len, device=device)
        return self.token_mask(pos, pos, self.num_blocks(seq_len))


@functools.lru_cache(maxsize=256)
def _block_layout(pattern: BigBirdPattern, num_blocks: int) -> torch.Tensor:
    n, w = num_blocks, pattern.window_blocks
    num_global = min(pattern.global_blocks, n)
    layout = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        first = max(i - w, 0)
        layout[i, first : (i if pattern.causal else min(i + w, n - 1)) + 1] = True
        layout[i, :num_global] = True
        if pattern.causal:
            candidates = list(range(num_global, first))
        else:
            candidates = [j for j in range(n) if not layout[i, j]]
        rng = random.Random(f"{pattern.seed}:{pattern.layer}:{i}")  # str seeds are hashed stably
        layout[i, rng.sample(candidates, min(pattern.random_blocks, len(candidates)))] = True
    if pattern.causal:
        return layout.tril()
    layout[:num_global] = True
    return layout


@dataclass(frozen=True)
class _CompactPlan:
    """How query blocks first_row.. of a `seq`-token sequence read their keys, all on the CPU."""

    blocks: torch.Tensor  # (rows, K): the key blocks each reads, padded with block 0
    key_pos: torch.Tensor  # (rows, K * size): the position of each gathered key
    own: torch.Tensor  # (rows, size, K * size): the query's own key
    mask: torch.Tensor  # (rows, size, K * size): what each query reads, padding aside


@functools.lru_cache(maxsize=16)
def _compact_plan(pattern: BigBirdPattern, seq: int, first_row: int) -> _CompactPlan:
    size = pattern.block_size
    n = pattern.num_blocks(seq)
    rows = _block_layout(pattern, n)[first_row:]
    # A stable sort puts each row's attended blocks first, in increasing order.
    order = torch.sort(rows.to(torch.int8), dim=1, descending=True, stable=True).indices[:, : int(rows.sum(1).max())]
    block_valid = rows.gather(1, order)
    blocks = order.masked_fill(~block_valid, 0)
    offsets = torch.arange(size)
    key_pos = (blocks[:, :, None] * size + offsets).flatten(1)[:, None, :]
    query_pos = (torch.arange(first_row, n)[:, None] * size + offsets)[:, :, None]
    own = key_pos == query_pos
    mask = block_valid.repeat_interleave(size, dim=1)[:, None, :] & ((key_pos < seq) | own)
    if pattern.causal:
        mask = mask & (key_pos <= query_pos)
    return _CompactPlan(blocks, key_pos[:, 0], own, mask)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BigBirdPattern,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of q over k, v under `pattern`, computed blockwise (linear in the sequence length).

    q, k, v: (batch, heads, seq, head_dim), the same number of heads (repeat grouped keys first);
    positions are the column indices. key_padding_mask: (batch, seq), True for real tokens; a
    query also reads its own key, so a padding query's row is never empty (as in
    llmstack.models.modeling_llmstack.attention_mask_4d). Equals scaled_dot_product_attention
    under `pattern.dense_mask(seq)` (and the padding rule) up to rounding.
    """
    batch, heads, seq, head_dim = q.shape
    size = pattern.block_size
    n = pattern.num_blocks(seq)
    padded = n * size
    if padded != seq:
        q, k, v = (F.pad(t, (0, 0, 0, padded - seq)) for t in (q, k, v))
    device = q.device
    key_valid = None
    if key_padding_mask is not None:
        key_valid = F.pad(key_padding_mask.to(device, torch.bool), (0, padded - seq))
    # Bidirectional global query blocks read every key: one dense attention over them.
    dense_rows = 0 if pattern.causal else min(pattern.global_blocks, n) * size
    parts = []
    if dense_rows:
        key_pos = torch.arange(padded, device=device)
        readable = (key_pos < seq)[None] if key_valid is None else key_valid
        mask = readable[:, None, :] | (torch.arange(dense_rows, device=device)[:, None] == key_pos)
        parts.append(
            F.scaled_dot_product_attention(q[:, :, :dense_rows], k, v, attn_mask=mask[:, None], dropout_p=dropout_p)
        )
    if dense_rows < padded:
        plan = _compact_plan(pattern, seq, dense_rows // size)
        blocks, mask = plan.blocks.to(device), plan.mask.to(device)[None]
        if key_valid is not None:
            mask = mask & (key_valid[:, plan.key_pos.to(device)][:, :, None, :] | plan.own.to(device))
        rows = blocks.shape[0]

        def gather(t: torch.Tensor) -> torch.Tensor:  # (batch, heads * rows, K * size, head_dim)
            return t.view(batch, heads, n, size, head_dim)[:, :, blocks].flatten(3, 4).flatten(1, 2)

        # 4-d operands, (batch, heads * rows, ...): SDPA's CPU kernels are about 2x faster on them than on 5-d.
        mask = mask[:, None].expand(-1, heads, -1, -1, -1).flatten(1, 2)
        query_blocks = q[:, :, dense_rows:].reshape(batch, heads * rows, size, head_dim)
        y = F.scaled_dot_product_attention(query_blocks, gather(k), gather(v), attn_mask=mask, dropout_p=dropout_p)
        parts.append(y.view(batch, heads, rows * size, head_dim))
    return torch.cat(parts, dim=2)[:, :, :seq] if len(parts) > 1 else parts[0][:, :, :seq]


def decoder_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BigBirdPattern,
    attn_mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The causal pattern inside llmstack's decoder. q: the newest q_len of k's positions.

    attn_mask None with q_len == k_len (training, a prefill without padding): blockwise. Otherwise
    (a decode step with a KV cache, or padding) the pattern runs over each row's real positions
    (its unmasked keys counted from 0, which left padding or a slotted cache's gaps skip), as one
    dense mask of (q_len, k_len): linear per new token. attn_mask is attention_mask_4d's
    (batch, 1, q, k) mask, whose last query row is exactly the row's real keys.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    if attn_mask is None and q_len == k_len:
        return sparse_attention(q, k, v, pattern, dropout_p=dropout_p)
    if attn_mask is None:
        k_pos = torch.arange(k_len, device=q.device)[None]
    else:
        k_pos = (attn_mask[:, 0, -1, :].long().cumsum(-1) - 1).clamp(min=0)
    mask = pattern.token_mask(k_pos[:, -q_len:], k_pos, pattern.num_blocks(k_len))[:, None]
    if attn_mask is not None:
        mask = mask & attn_mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def encoder_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BigBirdPattern,
    attn_mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The bidirectional pattern inside llmstack's encoder, blockwise with or without padding.
    attn_mask: attention_mask_4d's (batch, 1, seq, seq) mask (real keys, plus each query's own
    key), or None when nothing is padding. A key column is real when every query may read it."""
    key_padding_mask = None if attn_mask is None else attn_mask[:, 0].all(dim=1)
    return sparse_attention(q, k, v, pattern, key_padding_mask, dropout_p)
