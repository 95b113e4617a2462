"""Putting a server together: the model in llmstack's form, a KV cache sized from a memory
budget, the engine."""

from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from llmstack.models import from_llama

from ..speculative import SpeculativeConfig
from .engine import Engine
from .kv_cache import CacheShape, SlotKVCache
from .prefix_cache import PrefixCache

MIB = 2**20


def servable(model: PreTrainedModel) -> PreTrainedModel:
    """The engine drives llmstack's attention through its cache interface; a Llama-format model
    is the same network, so it is converted (no weights change)."""
    return from_llama(model).eval() if isinstance(model, LlamaForCausalLM) else model.eval()


def build_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    kv_cache_mb: float = 256,
    max_running: int = 32,
    max_waiting: int = 256,
    max_prefill_tokens: int = 512,
    chunked_prefill_size: int = 512,
    speculative: SpeculativeConfig | None = None,
    draft: PreTrainedModel | None = None,
    prefix_cache_mb: float = 0,
    prefix_block_size: int = 16,
) -> Engine:
    """An engine whose KV cache holds as many context-long slots as `kv_cache_mb` MiB allow
    (a draft model's cache has as many slots, outside the budget), and, when `prefix_cache_mb`
    is positive, a prefix cache of as many `prefix_block_size`-token blocks as that budget allows;
    raises ValueError when not even one slot (or block) fits or the draft does not fit the model."""
    model = servable(model)
    shape, context = CacheShape.of(model), model.config.max_position_embeddings
    slot_bytes = shape.bytes_per_token() * context
    if kv_cache_mb * MIB < slot_bytes:
        raise ValueError(
            f"one KV cache slot ({context} tokens) needs {slot_bytes / MIB:.2f} MiB; the budget is {kv_cache_mb} MiB"
        )
    device = next(model.parameters()).device
    cache = SlotKVCache.from_budget(shape, int(kv_cache_mb * MIB), context, device)
    prefix_cache = None
    if prefix_cache_mb > 0:
        block_bytes = shape.bytes_per_token() * prefix_block_size
        if prefix_cache_mb * MIB < block_bytes:
            raise ValueError(
                f"one prefix cache block ({prefix_block_size} tokens) needs {block_bytes / MIB:.3f} MiB; "
                f"the prefix cache budget is {prefix_cache_mb} MiB"
            )
        prefix_cache = PrefixCache.from_budget(shape, int(prefix_cache_mb * MIB), prefix_block_size, device)
    return Engine(
        model,
        tokenizer,
        cache,
        max_running=max_running,
        max_waiting=max_waiting,
        max_prefill_tokens=max_prefill_tokens,
        chunked_prefill_size=chunked_prefill_size,
        speculative=speculative,
        draft=None if draft is None else servable(draft),
        prefix_cache=prefix_cache,
    )


def batch_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    max_len: int,
    *,
    speculative: SpeculativeConfig | None = None,
    draft: PreTrainedModel | None = None,
) -> Engine:
    """An engine for one batch of prompts decoded together (`llmstack generate --speculative`):
    a slot of `max_len` tokens for each, all admitted at once."""
    model = servable(model)
    device = next(model.parameters()).device
    cache = SlotKVCache(CacheShape.of(model), num_prompts, min(max_len, model.config.max_position_embeddings), device)
    return Engine(
        model,
        tokenizer,
        cache,
        max_running=num_prompts,
        max_waiting=num_prompts,
        max_prefill_tokens=cache.max_len * num_prompts,
        chunked_prefill_size=0,  # all prompts at once: nothing runs yet that a long prefill would stall
        speculative=speculative,
        draft=None if draft is None else servable(draft),
    )
