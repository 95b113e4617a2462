"""Prefix caching in the engine: prompts that share a prefix reuse its cached keys/values and
their greedy tokens equal `generate` alone (prefixes shared partially, a prompt equal to a cached
prefix, eviction under the budget); the hit counters; speculative decoding and structured output
on top of it."""

import pytest
import torch
from inference_fixtures import random_prompts, serve_fixtures, tiny_model
from test_serve_engine import request, run_until_idle, tokens

from llmstack.inference import generate
from llmstack.inference.serve.engine import Engine
from llmstack.inference.serve.kv_cache import CacheShape, SlotKVCache
from llmstack.inference.serve.prefix_cache import PrefixCache
from llmstack.inference.serve.server import build_engine
from llmstack.inference.speculative import SpeculativeConfig

tokenizer, model = serve_fixtures()

BLOCK = 8


def cached_engine(model, tokenizer, num_blocks=64, num_slots=8, **kwargs):
    shape = CacheShape.of(model)
    prefix = PrefixCache(shape, num_blocks, BLOCK)
    return Engine(model, tokenizer, SlotKVCache(shape, num_slots, 128), prefix_cache=prefix, **kwargs)


def alone(model, tokenizer, prompts, new):
    eos = tokenizer.eos_token_id
    return [generate(model, [p], max_new_tokens=n, eos_token_id=eos)[0] for p, n in zip(prompts, new)]


def serve(engine, prompts, new, step_between=True, **kwargs):
    outputs = {}
    for i, (prompt, n) in enumerate(zip(prompts, new)):
        engine.submit(request(prompt, n, outputs, i, **kwargs))
        if step_between:  # each prompt is prefilled after the ones before it are stored
            engine.step()
    run_until_idle(engine)
    return [tokens(outputs[i]) for i in range(len(prompts))]


def value(engine, name):
    return engine.metrics.registry.get_sample_value(name) or 0.0


def shared_prefix_prompts():
    system, a, b, c = random_prompts([40, 13, 5, 20], seed=21)
    return [
        system + a,  # stores 6 blocks (48 of its 53 tokens)
        system + b,  # shares 40 tokens: 5 whole blocks reused
        system[:27] + c,  # shares 27 tokens: 3 whole blocks (24) reused, the 4th differs
        system,  # equal to a cached prefix: all but its last token reused
        system[:16],  # equal to 2 cached blocks: 15 tokens reused
        system + a,  # a repeat: 48 of 53 reused
        c + system,  # shares nothing at position 0: no reuse
        system[:1],  # one token: nothing to reuse
    ]


def test_greedy_tokens_with_a_prefix_cache_equal_generate_alone(model, tokenizer):
    prompts, new = shared_prefix_prompts(), [10, 12, 8, 9, 11, 10, 7, 6]
    engine = cached_engine(model, tokenizer)
    assert serve(engine, prompts, new) == alone(model, tokenizer, prompts, new)
    reused = [0, 40, 24, 39, 15, 48, 0, 0]
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") == sum(reused)
    assert value(engine, "llmstack_prefix_cache_query_tokens_total") == sum(len(p) for p in prompts)
    assert value(engine, "llmstack_prefix_cache_tokens") == engine.prefix_cache.cached_tokens > 0
    exposition = engine.metrics.exposition().decode()  # what GET /metrics returns
    assert f"llmstack_prefix_cache_hit_tokens_total {float(sum(reused))}" in exposition


def test_a_burst_admitted_together_reuses_the_prefix_the_first_one_stores(model, tokenizer):
    system = random_prompts([33], seed=22)[0]
    prompts = [system + tail for tail in random_prompts([4, 9, 1, 6], seed=23)]
    new = [8, 5, 9, 6]
    engine = cached_engine(model, tokenizer, max_prefill_tokens=10_000)
    assert serve(engine, prompts, new, step_between=False) == alone(model, tokenizer, prompts, new)
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") == 3 * 32


def test_eviction_under_the_budget_keeps_outputs_exact_and_evicts_deepest_blocks_first(model, tokenizer):
    first, second = random_prompts([40, 40], seed=24)
    engine = cached_engine(model, tokenizer, num_blocks=6)
    prompts = [first, second, first, second + first[:3]]
    new = [6, 6, 6, 6]
    assert serve(engine, prompts, new) == alone(model, tokenizer, prompts, new)
    cache = engine.prefix_cache
    assert len(cache.blocks) == 6 and not cache.free
    # each prompt of 5 blocks in a pool of 6 evicts the other's 4 deepest blocks and keeps its first
    assert cache.match(second) == 5 * BLOCK and cache.match(first) == 1 * BLOCK
    # hits: none, none, first's 1 surviving block (8), second's 1 surviving block (8)
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") == 16


def test_a_prompt_longer_than_the_pool_keeps_its_first_blocks(model, tokenizer):
    prompt = random_prompts([60], seed=25)[0]
    engine = cached_engine(model, tokenizer, num_blocks=3)
    assert serve(engine, [prompt, prompt], [5, 5]) == alone(model, tokenizer, [prompt, prompt], [5, 5])
    assert engine.prefix_cache.match(prompt) == 3 * BLOCK
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") == 3 * BLOCK


def test_the_pool_holds_what_the_slot_held():
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    slots, prefix = SlotKVCache(shape, 2, 32), PrefixCache(shape, 4, 4)
    for layer in slots.keys + slots.values:
        layer.normal_()
    tokens_ = list(range(2, 13))  # 11 tokens: 2 full blocks
    assert prefix.store(tokens_, slots, 1) == 2 and prefix.store(tokens_, slots, 1) == 0
    assert prefix.load(tokens_ + [99], slots, 0, limit=11) == 8
    for layer in slots.keys + slots.values:
        assert torch.equal(layer[0, :, :8], layer[1, :, :8])
        assert not torch.equal(layer[0, :, 8:11], layer[1, :, 8:11])
    assert prefix.load(tokens_[:8], slots, 0, limit=7) == 7


def test_prompt_lookup_speculation_on_a_prefix_cache_equals_generate_alone(model, tokenizer):
    prompts, new = shared_prefix_prompts(), [10, 12, 8, 9, 11, 10, 7, 6]
    engine = cached_engine(model, tokenizer, speculative=SpeculativeConfig("ngram", num_tokens=3))
    assert serve(engine, prompts, new) == alone(model, tokenizer, prompts, new)
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") > 0


def test_a_draft_model_on_a_prefix_cache_equals_generate_alone(model, tokenizer):
    draft = tiny_model(seed=1, vocab_size=len(tokenizer), max_position_embeddings=128)
    prompts, new = shared_prefix_prompts()[:4], [10, 12, 8, 9]
    engine = cached_engine(model, tokenizer, speculative=SpeculativeConfig("draft", num_tokens=3), draft=draft)
    assert serve(engine, prompts, new) == alone(model, tokenizer, prompts, new)
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") > 0


def test_structured_output_on_a_prefix_cache_still_parses(model, tokenizer):
    pytest.importorskip("llguidance")
    import json

    from llmstack.inference.structured import json_schema_grammar

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    grammar = json_schema_grammar(schema)
    engine = cached_engine(model, tokenizer)
    outputs = serve(engine, shared_prefix_prompts()[:3], [40, 40, 40], grammar=grammar)
    for output in outputs:
        assert set(json.loads(tokenizer.decode(output))) == {"n"}
    assert value(engine, "llmstack_prefix_cache_hit_tokens_total") > 0


def test_build_engine_sizes_the_prefix_cache_from_its_budget(model, tokenizer):
    engine = build_engine(model, tokenizer, kv_cache_mb=1, prefix_cache_mb=0.5, prefix_block_size=4)
    assert engine.prefix_cache is not None
    assert engine.prefix_cache.num_blocks == int(0.5 * 2**20) // (CacheShape.of(model).bytes_per_token() * 4)
    assert build_engine(model, tokenizer, kv_cache_mb=1).prefix_cache is None
    with pytest.raises(ValueError, match="one prefix cache block"):
        build_engine(model, tokenizer, kv_cache_mb=1, prefix_cache_mb=1e-5)
