"""Putting a server together: the model in llmstack's form, a KV cache sized from a memory
budget, the engine, the app, uvicorn."""

import torch
from transformers import LlamaForCausalLM

from llmstack.models import from_llama
from .engine import Engine
from .kv_cache import CacheShape, PagedKVCache

MIB = 2**20


def servable(model: torch.nn.Module) -> torch.nn.Module:
    """The engine drives llmstack's attention through its cache interface; a Llama-format model
    is the same network, so it is converted (no weights change)."""
    return from_llama(model).eval() if isinstance(model, LlamaForCausalLM) else model.eval()


def build_engine(model: torch.nn.Module, tokenizer, *, kv_cache_mb: float = 256, block_size: int = 16,
                 max_running: int = 32, max_waiting: int = 256) -> Engine:
    """An engine whose KV cache holds as many blocks as `kv_cache_mb` MiB allow; raises ValueError
    when not even one block fits."""
    model = servable(model)
    shape = CacheShape.of(model)
    cache = PagedKVCache.from_budget(shape, int(kv_cache_mb * MIB), block_size, next(model.parameters()).device) \
        if kv_cache_mb * MIB >= shape.bytes_per_token() * block_size else None
    if cache is None:
        raise ValueError(f"a KV cache block of {block_size} tokens needs "
                         f"{shape.bytes_per_token() * block_size / MIB:.3f} MiB; the budget is {kv_cache_mb} MiB")
    return Engine(model, tokenizer, cache, max_running=max_running, max_waiting=max_waiting)
