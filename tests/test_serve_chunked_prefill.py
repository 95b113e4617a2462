"""Chunked prefill: prompts longer than several 7-token chunks, arriving while others decode, give
the same greedy tokens as unchunked prefill (and `generate` alone), with a prefix cache, prompt
lookup, a draft model and structured output; the running requests get a token at every step of a
long prompt's prefill, in one forward per step over the chunk and the running rows, whose logits
equal separate forwards'; a request cancelled mid-prefill frees its slot."""

import json

import pytest
import torch
from inference_fixtures import random_prompts, serve_fixtures, tiny_model
from test_serve_engine import engine_for, request, run_until_idle, tokens
from test_serve_prefix_cache import alone, cached_engine, shared_prefix_prompts, value

from llmstack.inference import SamplingParams
from llmstack.inference.serve.kv_cache import CacheShape, CacheView, PackedView, SlotKVCache
from llmstack.inference.speculative import SpeculativeConfig
from llmstack.inference.structured import json_object_grammar

tokenizer, model = serve_fixtures()

CHUNK = 7
LENGTHS = [40, 3, 33, 60, 9, 25, 47, 14]  # most over several chunks; two fit one chunk whole
NEW = [10, 14, 6, 9, 12, 5, 8, 11]


def serve(engine, prompts, new, **kwargs):
    """Submit a prompt, step once, submit the next: each arrives while the earlier ones decode (or
    are still being prefilled)."""
    outputs = {}
    for i, (prompt, n) in enumerate(zip(prompts, new)):
        engine.submit(request(prompt, n, outputs, i, **kwargs))
        engine.step()
    run_until_idle(engine)
    return [tokens(outputs[i]) for i in range(len(prompts))]


def test_greedy_tokens_with_7_token_chunks_equal_unchunked_and_generate_alone(model, tokenizer):
    prompts = random_prompts(LENGTHS, seed=31)
    chunked = engine_for(model, tokenizer, num_slots=4, chunked_prefill_size=CHUNK)
    unchunked = engine_for(model, tokenizer, num_slots=4, chunked_prefill_size=0)
    expected = alone(model, tokenizer, prompts, NEW)
    assert serve(chunked, prompts, NEW) == serve(unchunked, prompts, NEW) == expected
    chunks = value(chunked, "llmstack_prefill_chunks_total")
    assert chunks >= sum(-(-n // CHUNK) for n in LENGTHS) and value(unchunked, "llmstack_prefill_chunks_total") == 8
    assert value(chunked, "llmstack_prefill_tokens_total") == sum(LENGTHS)
    assert chunked.prefilling is None and value(chunked, "llmstack_kv_cache_slots_used") == 0


def test_running_requests_get_a_token_at_every_step_of_a_long_prefill(model, tokenizer):
    short, long = random_prompts([5, 100], seed=32)
    engine, outputs = engine_for(model, tokenizer, num_slots=3, chunked_prefill_size=CHUNK), {}
    engine.submit(request(short, 20, outputs, "short", ignore_eos=True))
    engine.step()
    engine.submit(request(long, 4, outputs, "long"))
    steps, running = 0, engine.running[0]
    while engine.waiting:
        before = len(running.output)
        engine.step()
        steps += 1
        assert len(running.output) == before + 1  # one token per step: no stall
        assert engine.prefilling is None or engine.cache.num_slots - 1 not in range(len(engine.running))
    assert steps == -(-100 // CHUNK)
    run_until_idle(engine)
    assert tokens(outputs["long"]) == alone(model, tokenizer, [long], [4])[0]


def test_each_step_is_one_forward_over_the_chunk_and_the_running_rows(model, tokenizer):
    first, second, long = random_prompts([5, 9, 30], seed=36)
    engine, outputs = engine_for(model, tokenizer, num_slots=4, chunked_prefill_size=CHUNK), {}
    rows = []
    hook = model.register_forward_hook(lambda module, args, out: rows.append(tuple(args[0].shape)))
    try:
        engine.submit(request(first, 12, outputs, "first", ignore_eos=True))
        engine.submit(request(second, 12, outputs, "second", ignore_eos=True))
        engine.step()  # the first prompt (5 tokens) whole, then 2 of the second's 9 in the last slot
        engine.submit(request(long, 3, outputs, "long", ignore_eos=True))
        for _ in range(6):
            engine.step()
    finally:
        hook.remove()
    # one forward a step: the prompt tokens (the second's last 7, then chunks of the long one, its
    # last of 2), then one token of each running row
    assert rows == [(1, 7), (1, 7 + 1), (1, 7 + 2), (1, 7 + 2), (1, 7 + 2), (1, 7 + 2), (1, 2 + 2)]
    run_until_idle(engine)
    prompts = [first, second, long]
    assert [tokens(outputs[k]) for k in ("first", "second", "long")] == alone(model, tokenizer, prompts, [12, 12, 3])


def test_a_packed_forward_gives_the_logits_of_separate_prefill_and_decode_forwards(model):
    """Two rows decoding (one with 2 speculative tokens, one padded) beside the second chunk of a
    prompt: the packed forward's logits and cache equal a prefill forward's and a decode forward's."""
    running, prompt = random_prompts([11, 6], seed=37), random_prompts([20], seed=38)[0]
    caches = [SlotKVCache(CacheShape.of(model), 3, 64) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            for slot, tokens_ in enumerate([*running, prompt[:12]]):
                model(torch.tensor([tokens_]), cache=CacheView(cache, slot=slot), use_cache=True)
        lengths, new = torch.tensor([11, 6]), [[7, 8, 9], [10, 0, 0]]
        chunk = CacheView(caches[0], slot=2, start=12)
        alone_chunk = model(torch.tensor([prompt[12:]]), position_ids=torch.arange(12, 20)[None], cache=chunk).logits
        decode = CacheView(caches[0], lengths=lengths, new_tokens=3)
        alone_decode = model(
            torch.tensor(new),
            attention_mask=decode.attention_mask(),
            position_ids=lengths[:, None] + torch.arange(3),
            cache=decode,
        ).logits
        decode.commit()
        packed = PackedView(
            [(CacheView(caches[1], slot=2, start=12), 8)], CacheView(caches[1], lengths=lengths, new_tokens=3)
        )
        positions = [*range(12, 20), *range(11, 14), *range(6, 9)]
        logits = model(
            torch.tensor([prompt[12:] + new[0] + new[1]]), position_ids=torch.tensor([positions]), cache=packed
        ).logits
        packed.commit()
    torch.testing.assert_close(logits[0, :8], alone_chunk[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0, 8:].view(2, 3, -1), alone_decode, rtol=1e-5, atol=1e-5)
    for pool, other in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        torch.testing.assert_close(pool[0, :, :14], other[0, :, :14], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[1, :, :9], other[1, :, :9], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[2, :, :20], other[2, :, :20], rtol=1e-5, atol=1e-5)


def test_chunks_after_a_cached_prefix_equal_generate_alone(model, tokenizer):
    prompts, new = shared_prefix_prompts(), [10, 12, 8, 9, 11, 10, 7, 6]
    engine = cached_engine(model, tokenizer, num_slots=4, chunked_prefill_size=CHUNK)
    assert serve(engine, prompts, new) == alone(model, tokenizer, prompts, new)
    hits = value(engine, "llmstack_prefix_cache_hit_tokens_total")
    assert hits > 0 and value(engine, "llmstack_prefill_tokens_total") == sum(len(p) for p in prompts) - hits


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_chunked_prefill_with_speculative_decoding_equals_generate_alone(model, tokenizer, method):
    draft = None
    if method == "draft":
        draft = tiny_model(seed=1, vocab_size=len(tokenizer), max_position_embeddings=128)
    prompts = random_prompts(LENGTHS, seed=33)
    spec = SpeculativeConfig(method, num_tokens=3)
    engine = engine_for(model, tokenizer, num_slots=4, chunked_prefill_size=CHUNK, speculative=spec, draft=draft)
    assert serve(engine, prompts, NEW) == alone(model, tokenizer, prompts, NEW)
    assert value(engine, "llmstack_speculative_draft_tokens_total") > 0


def test_chunked_prefill_with_structured_output_equals_unchunked(model, tokenizer):
    prompts = random_prompts([30, 45, 20], seed=34)
    options = dict(sampling=SamplingParams(temperature=0.0), grammar=json_object_grammar())
    results = []
    for size in (CHUNK, 0):
        engine = engine_for(model, tokenizer, num_slots=4, chunked_prefill_size=size)
        results.append(serve(engine, prompts, [40] * 3, **options))
    assert results[0] == results[1]
    for output in results[0]:
        text = tokenizer.decode(output, skip_special_tokens=True)
        if output and len(output) < 40:  # ended by the grammar: a whole object
            assert isinstance(json.loads(text), dict)


def test_a_request_cancelled_mid_prefill_frees_its_slot(model, tokenizer):
    long, other = random_prompts([60, 12], seed=35)
    engine, outputs = engine_for(model, tokenizer, num_slots=2, chunked_prefill_size=CHUNK), {}
    engine.submit(request(long, 5, outputs, "long"))
    engine.step()
    assert engine.prefilling is not None and value(engine, "llmstack_kv_cache_slots_used") == 1
    engine.abort(engine.prefilling.request.id)
    engine.submit(request(other, 6, outputs, "other"))
    run_until_idle(engine)
    assert outputs["long"][-1].finish_reason == "abort" and engine.prefilling is None
    assert tokens(outputs["other"]) == alone(model, tokenizer, [other], [6])[0]


def test_a_negative_chunk_size_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        engine_for(model, tokenizer, chunked_prefill_size=-1)
