"""Prefix caching: the keys/values of prompt blocks, kept for later requests whose prompts begin
with the same tokens.

A prompt is cut into blocks of `block_size` tokens; block i is named by a digest of block i's
tokens and the name of block i - 1, so a name stands for the whole prefix up to the block's end
(as in vLLM). After a prompt's prefill, the keys/values of its full blocks are copied from the
request's slot into a pool allocated once from a memory budget; a later prompt looks up its
blocks in order, and the longest cached run of them is copied into its own slot, so only the
rest of the prompt is prefilled (at positions after the copied ones). This is copy-on-hit over
the slotted cache, not vLLM's paged blocks shared in place: a hit costs a copy of the cached
keys/values into the slot (memory traffic, no compute), and a running request's slot never
points into the pool.

Eviction is least recently used, one block at a time. Each lookup or store touches a prompt's
blocks last first, so a block is always more recent than the blocks that extend it and the
deepest block of a prefix goes first: no cached block ever lacks its parent.
"""

import hashlib
from collections import OrderedDict

import torch

from .kv_cache import CacheShape, SlotKVCache


class PrefixCache:
    def __init__(
        self, shape: CacheShape, num_blocks: int, block_size: int = 16, device: str | torch.device = "cpu"
    ) -> None:
        if block_size < 1:
            raise ValueError("the prefix cache's block size must be >= 1")
        if num_blocks < 1:
            raise ValueError("the prefix cache needs room for at least one block")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.keys, self.values = shape.zeros(num_blocks, block_size, device)
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # name -> pool index, least recent first
        self.free = list(range(num_blocks - 1, -1, -1))

    @classmethod
    def from_budget(
        cls, shape: CacheShape, memory_bytes: int, block_size: int = 16, device: str | torch.device = "cpu"
    ) -> "PrefixCache":
        return cls(shape, memory_bytes // (shape.bytes_per_token() * block_size), block_size, device)

    def names(self, tokens: list[int]) -> list[bytes]:
        """The name of each full block of `tokens`."""
        names, parent = [], b""
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            block = tokens[start : start + self.block_size]
            parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
            names.append(parent)
        return names

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are cached (a multiple of the block size), touching nothing."""
        hits = 0
        for name in self.names(tokens):
            if name not in self.blocks:
                break
            hits += 1
        return hits * self.block_size

    def load(self, tokens: list[int], cache: SlotKVCache, slot: int, limit: int) -> int:
        """Copy the keys/values of the longest cached prefix of `tokens`, at most `limit` tokens,
        into positions 0.. of `slot`; returns how many tokens were copied."""
        names = []
        for name in self.names(tokens[: limit + self.block_size - 1]):
            if name not in self.blocks:
                break
            names.append(name)
        self._touch(names)
        length = min(len(names) * self.block_size, limit)
        if length == 0:
            return 0
        index = torch.tensor([self.blocks[n] for n in names], device=self.keys[0].device)
        for pool, slots in zip(self.keys + self.values, cache.keys + cache.values):
            # (blocks, heads, block, dim) -> (heads, blocks * block, dim)
            gathered = pool[index].transpose(0, 1).flatten(1, 2)
            slots[slot, :, :length] = gathered[:, :length]
        return length

    def store(self, tokens: list[int], cache: SlotKVCache, slot: int) -> int:
        """Keep the full blocks of `tokens`, whose keys/values are in positions 0.. of `slot`, that
        are not cached yet (evicting the least recently used as needed); returns how many were added."""
        names = self.names(tokens)[: self.num_blocks]
        cached = 0
        while cached < len(names) and names[cached] in self.blocks:
            cached += 1
        self._touch(names[:cached])  # at the recent end: not evicted for the new blocks
        new = names[cached:]
        index = []
        for name in new:
            if not self.free:
                _, freed = self.blocks.popitem(last=False)
                self.free.append(freed)
            index.append(self.free.pop())
            self.blocks[name] = index[-1]
        if new:
            rows = torch.tensor(index, device=self.keys[0].device)
            start, end = cached * self.block_size, len(names) * self.block_size
            for pool, slots in zip(self.keys + self.values, cache.keys + cache.values):
                # (heads, blocks * block, dim) -> (blocks, heads, block, dim)
                heads, _, dim = slots.shape[1:]
                pool[rows] = slots[slot, :, start:end].reshape(heads, len(new), self.block_size, dim).transpose(0, 1)
        self._touch(names)
        return len(new)

    def _touch(self, names: list[bytes]) -> None:
        """Mark a prompt's blocks the most recently used, its first block most of all."""
        for name in reversed(names):
            self.blocks.move_to_end(name)

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size
