"""A slotted KV cache: per layer one tensor (slots, kv_heads, max_len, head_dim) allocated once from
a memory budget; each running sequence owns one slot (a row), and the running sequences hold
slots 0..n-1, so the batch's keys are a view of the first n rows, with no copy.

Why slots and not vLLM's paged blocks: without a paged-attention kernel, attention over blocks
must first gather every sequence's keys into a dense tensor at each step. On this project's CPU
machine a decode step of the 13.8M baseline model, batch 16 x 600 cached tokens, took 335 ms with
the gather against 82 ms reading a dense view (one token alone: 16 ms), so paging made batching
slower than serving one request at a time. Slots reserve a whole context per sequence instead.

`CacheView` adapts the cache to the model's cache interface (`update(keys, values, layer_idx)`
and `get_seq_length()`, the part of transformers' `Cache` that llmstack's attention calls);
`PackedView` to its packed one (llmstack.models' `PackedCache`), for a step's one forward.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from llmstack.models.modeling_llmstack import attention_mask_4d


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: PreTrainedModel) -> "CacheShape":
        config = model.config
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, model.dtype)

    def zeros(
        self, rows: int, length: int, device: str | torch.device = "cpu"
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer key and value tensors (rows, kv heads, length, head dim), zeroed: masked
        columns are read too, and a masked NaN would still poison the attention output (0 * NaN)."""
        size = (rows, self.num_kv_heads, length, self.head_dim)
        keys = [torch.zeros(size, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        values = [torch.zeros(size, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
        return keys, values

    def bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class SlotKVCache:
    def __init__(self, shape: CacheShape, num_slots: int, max_len: int, device: str | torch.device = "cpu") -> None:
        if num_slots < 1:
            raise ValueError("the KV cache needs at least one slot")
        self.shape, self.num_slots, self.max_len = shape, num_slots, max_len
        self.keys, self.values = shape.zeros(num_slots, max_len, device)

    @classmethod
    def from_budget(
        cls, shape: CacheShape, memory_bytes: int, max_len: int, device: str | torch.device = "cpu"
    ) -> "SlotKVCache":
        return cls(shape, memory_bytes // (shape.bytes_per_token() * max_len), max_len, device)

    def move(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `target`."""
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[target, :, :length] = layer[source, :, :length]


class CacheView:
    """The cache one forward sees.

    Prefill (`slot` given): one sequence in that slot whose first `start` positions are filled
    already (a cached prefix; none for a fresh one); the new keys/values are written at positions
    start.. and it attends to positions 0.. up to them. Decode (`lengths` given): `new_tokens` new tokens
    (one, or a speculative step's guesses) for each of the sequences in slots 0..n-1, which have
    `lengths` tokens cached. Attention reads the view `[:n, :, :width]`, width = longest +
    new_tokens: each row's new keys/values are written to the last `new_tokens` columns (past
    every row's cached tokens), where llmstack's causal mask lets the new tokens see each other,
    and the caller's attention mask hides each row's columns from its length up to them.
    `commit` then copies them to each row's own next positions, which later steps read (not
    during the forward: for a shorter row those positions may be among the last columns).
    """

    def __init__(
        self,
        cache: SlotKVCache,
        *,
        slot: int | None = None,
        start: int = 0,
        lengths: torch.Tensor | None = None,
        new_tokens: int = 1,
    ) -> None:
        self.cache, self.slot, self.start, self.lengths, self.new_tokens = cache, slot, start, lengths, new_tokens
        self.width = None if lengths is None else int(lengths.max()) + new_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start if self.width is None else self.width - self.new_tokens

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values: (batch, kv_heads, new tokens, head_dim) -> what the new tokens attend to."""
        pools = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        if self.lengths is None or self.width is None:
            assert self.slot is not None, "a prefill view has a slot"
            end = self.start + keys.shape[2]
            for pool, new in zip(pools, (keys, values)):
                pool[self.slot, :, self.start : end] = new[0]
            if self.start == 0:
                return keys, values
            return pools[0][self.slot : self.slot + 1, :, :end], pools[1][self.slot : self.slot + 1, :, :end]
        n = len(self.lengths)
        for pool, new in zip(pools, (keys, values)):
            pool[:n, :, self.width - self.new_tokens : self.width] = new
        return pools[0][:n, :, : self.width], pools[1][:n, :, : self.width]

    def commit(self) -> None:
        """After a decode forward: move each row's new keys/values to its positions lengths.."""
        assert self.lengths is not None and self.width is not None, "only a decode view commits"
        n = len(self.lengths)
        rows = torch.arange(n, device=self.lengths.device)[:, None]
        columns = self.lengths[:, None] + torch.arange(self.new_tokens, device=self.lengths.device)
        for tensors in (self.cache.keys, self.cache.values):
            for pool in tensors:
                # (n, heads, new, dim) -> (n, new, heads, dim), the layout of indexing rows and columns
                new = pool[:n, :, self.width - self.new_tokens : self.width].transpose(1, 2).clone()
                pool[rows, :, columns] = new

    def attention_mask(self) -> torch.Tensor:
        """(batch, width): each row's cached positions and the last columns (the new tokens)."""
        assert self.lengths is not None and self.width is not None, "only a decode view has an attention mask"
        columns = torch.arange(self.width, device=self.lengths.device)
        mask = (columns[None, :] < self.lengths[:, None]) | (columns[None, :] >= self.width - self.new_tokens)
        return mask.long()


class PackedView:
    """The cache of one forward over a step's tokens packed in one row (vLLM's flattened batch):
    first each prefill's prompt tokens (`prefills`: prefill views, each with its token count),
    then the decode rows' new tokens, row after row (`decode`: a decode view, or None). The model
    runs its projections, norms and MLP once over all of them; each layer's attention is split
    here: each prefill attends through its view (its slot, causally to itself), and the decode
    rows attend against their slots through theirs, each group with the very mask and shapes its
    forward of its own would give it, so a group's attention is what that forward computes."""

    def __init__(self, prefills: list[tuple[CacheView, int]], decode: CacheView | None) -> None:
        self.prefills, self.decode = prefills, decode
        self.masks = [attention_mask_4d(None, count, view.start, view.cache.keys[0].device) for view, count in prefills]
        self.decode_mask = None
        if decode is not None and decode.width is not None:
            past = decode.width - decode.new_tokens
            self.decode_mask = attention_mask_4d(
                decode.attention_mask(), decode.new_tokens, past, decode.cache.keys[0].device
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    ) -> torch.Tensor:
        """q, k, v: (1, heads, tokens, head_dim) in the packed order -> attention output, same order."""
        outputs, offset = [], 0
        for (view, count), mask in zip(self.prefills, self.masks):
            part = slice(offset, offset + count)
            keys, values = view.update(k[:, :, part], v[:, :, part], layer_idx)
            outputs.append(attend(q[:, :, part], keys, values, mask))
            offset += count
        if self.decode is not None:
            rows = len(self.decode.lengths) if self.decode.lengths is not None else 0

            def per_row(x: torch.Tensor) -> torch.Tensor:  # (1, heads, rows * new, dim) -> (rows, heads, new, dim)
                return x[0, :, offset:].unflatten(1, (rows, -1)).transpose(0, 1)

            keys, values = self.decode.update(per_row(k), per_row(v), layer_idx)
            y = attend(per_row(q), keys, values, self.decode_mask)
            outputs.append(y.transpose(0, 1).flatten(1, 2)[None])
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]

    def commit(self) -> None:
        """After the forward: the decode rows' new keys/values to their own positions."""
        if self.decode is not None:
            self.decode.commit()
