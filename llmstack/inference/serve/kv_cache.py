"""A paged KV cache: every layer's keys and values live in one pool of fixed-size blocks, and a
sequence owns a list of blocks (its block table), as in vLLM's PagedAttention.

The pool is allocated once, from a memory budget, so serving never allocates KV memory per request
and a request the free blocks cannot hold waits instead of failing. `CacheView` adapts the pool to
the model's cache interface (`update(keys, values, layer_idx)` and `get_seq_length()`, the part of
transformers' `Cache` that llmstack's attention calls) for one forward over a batch of sequences.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> "CacheShape":
        config = model.config
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, model.dtype)

    def bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class PagedKVCache:
    """`num_blocks` blocks of `block_size` token slots per layer, handed out and taken back whole."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int = 16, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        slots = (num_blocks * block_size, shape.num_kv_heads, shape.head_dim)
        # Zeros, not empty: padding columns read slot 0 and are masked out, and a masked NaN
        # would still poison the attention output (0 * NaN).
        self.keys = [torch.zeros(slots, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(slots, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.free_blocks = list(range(num_blocks))

    @classmethod
    def from_budget(cls, shape: CacheShape, memory_bytes: int, block_size: int = 16,
                    device: str | torch.device = "cpu") -> "PagedKVCache":
        return cls(shape, memory_bytes // (shape.bytes_per_token() * block_size), block_size, device)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens, or None when too few are free."""
        needed = self.blocks_for(num_tokens)
        if needed > len(self.free_blocks):
            return None
        blocks, self.free_blocks = self.free_blocks[:needed], self.free_blocks[needed:]
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

    def slots(self, blocks: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
        """Flat slot index of each token position a sequence holding `blocks` can reach."""
        starts = torch.as_tensor(blocks, dtype=torch.long, device=device)[:, None] * self.block_size
        return (starts + torch.arange(self.block_size, device=device)).reshape(-1)


class CacheView:
    """The cache one forward sees. The step's keys/values are written to `write_slots`
    (batch, new tokens); attention then reads `read_slots` (batch, keys), each row the sequence's
    slots left-padded to the longest (the caller masks the padding). With `read_slots` None the
    batch is fresh sequences with nothing cached, whose own keys/values are all they attend to.
    """

    def __init__(self, cache: PagedKVCache, write_slots: torch.Tensor, read_slots: torch.Tensor | None = None):
        self.cache, self.write_slots, self.read_slots = cache, write_slots.reshape(-1), read_slots

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Keys cached before this step, as the model's attention mask counts them (padding included)."""
        return 0 if self.read_slots is None else self.read_slots.shape[1] - self.write_slots.numel() // self.read_slots.shape[0]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values: (batch, kv_heads, new tokens, head_dim) -> what the new tokens attend to."""
        pool_keys, pool_values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        heads, dim = keys.shape[1], keys.shape[3]
        pool_keys.index_copy_(0, self.write_slots, keys.transpose(1, 2).reshape(-1, heads, dim))
        pool_values.index_copy_(0, self.write_slots, values.transpose(1, 2).reshape(-1, heads, dim))
        if self.read_slots is None:
            return keys, values
        return pool_keys[self.read_slots].transpose(1, 2), pool_values[self.read_slots].transpose(1, 2)
