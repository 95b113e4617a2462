"""The continuous-batching engine, stepped by hand: outputs equal `generate` alone, admission
under a KV cache budget, cancellation."""

import pytest
from inference_fixtures import random_prompts, serve_fixtures

from llmstack import to_llama
from llmstack.inference import SamplingParams, generate
from llmstack.inference.serve.engine import Engine, GenerationRequest, QueueFull, RequestRejected
from llmstack.inference.serve.kv_cache import CacheShape, SlotKVCache
from llmstack.inference.serve.server import build_engine

tokenizer, model = serve_fixtures()

LENGTHS = [3, 40, 17, 48, 8, 33, 24, 5, 45, 12, 29, 7, 25, 37, 2, 20]
NEW = [12, 6, 16, 4, 10, 5, 16, 8, 7, 11, 16, 9, 6, 13, 14, 10]


def engine_for(model, tokenizer, num_slots=16, **kwargs):
    return Engine(model, tokenizer, SlotKVCache(CacheShape.of(model), num_slots, 128), **kwargs)


def request(prompt, max_tokens, outputs, key, **kwargs):
    def on_event(event):
        outputs.setdefault(key, []).append(event)

    return GenerationRequest(prompt, max_tokens, on_event=on_event, **kwargs)


def run_until_idle(engine):
    while engine.waiting or engine.running:
        engine.step()


def tokens(events):
    return [t for e in events for t in e.token_ids]


def test_greedy_tokens_equal_generate_alone_beside_15_others_arriving_mid_decode(model, tokenizer):
    prompts = random_prompts(LENGTHS)
    alone = [
        generate(model, [p], max_new_tokens=n, eos_token_id=tokenizer.eos_token_id)[0] for p, n in zip(prompts, NEW)
    ]
    engine, outputs = engine_for(model, tokenizer), {}
    joined_a_running_batch = 0
    for i, (prompt, new) in enumerate(zip(prompts, NEW)):
        joined_a_running_batch += bool(engine.running)
        engine.submit(request(prompt, new, outputs, i))
        if i % 3 == 0:  # later requests join a batch already decoding
            engine.step()
    assert joined_a_running_batch == 15
    run_until_idle(engine)
    assert [tokens(outputs[i]) for i in range(16)] == alone
    assert {len(a) for a in alone} == set(NEW)  # rows end at different steps: the last moves into freed slots
    assert engine.metrics.registry.get_sample_value("llmstack_kv_cache_slots_used") == 0


def test_one_request_alone_equals_generate_and_its_text_is_the_decoded_tokens(model, tokenizer):
    prompt = random_prompts([20], seed=3)[0]
    engine, outputs = engine_for(model, tokenizer), {}
    engine.submit(request(prompt, 30, outputs, 0))
    run_until_idle(engine)
    expected = generate(model, [prompt], max_new_tokens=30, eos_token_id=tokenizer.eos_token_id)[0]
    assert tokens(outputs[0]) == expected
    assert "".join(e.text for e in outputs[0]) == tokenizer.decode(expected, skip_special_tokens=True)
    assert outputs[0][-1].finish_reason == "length" and outputs[0][-1].completion_tokens == 30


def test_seeded_sampling_equals_generate_alone_with_that_seed(model, tokenizer):
    prompts = random_prompts([9, 30, 4], seed=1)
    sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2)
    engine, outputs = engine_for(model, tokenizer), {}
    for i, prompt in enumerate(prompts):
        engine.submit(request(prompt, 12, outputs, i, sampling=sampling, seed=100 + i))
    run_until_idle(engine)
    for i, prompt in enumerate(prompts):
        expected = generate(
            model, [prompt], max_new_tokens=12, sampling=sampling, seed=100 + i, eos_token_id=tokenizer.eos_token_id
        )[0]
        assert tokens(outputs[i]) == expected


def test_a_llama_format_model_serves_the_same_tokens(model, tokenizer):
    prompt = random_prompts([15], seed=4)[0]
    engine, outputs = build_engine(to_llama(model).eval(), tokenizer, kv_cache_mb=1), {}
    engine.submit(request(prompt, 16, outputs, 0))
    run_until_idle(engine)
    assert tokens(outputs[0]) == generate(model, [prompt], max_new_tokens=16, eos_token_id=tokenizer.eos_token_id)[0]


def test_stop_strings_end_the_text_before_them(model, tokenizer):
    prompt = random_prompts([10], seed=5)[0]
    full = tokenizer.decode(generate(model, [prompt], max_new_tokens=30)[0], skip_special_tokens=True)
    stop = next(
        full[i : i + 2] for i in range(3, len(full)) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    engine, outputs = engine_for(model, tokenizer), {}
    engine.submit(request(prompt, 30, outputs, 0, stop=(stop,), ignore_eos=True))
    run_until_idle(engine)
    assert "".join(e.text for e in outputs[0]) == full[: full.find(stop)]
    assert outputs[0][-1].finish_reason == "stop"


def test_a_request_that_finds_no_free_slot_waits_and_then_runs(model, tokenizer):
    engine, outputs = engine_for(model, tokenizer, num_slots=1), {}
    first, second = random_prompts([30, 20], seed=6)
    engine.submit(request(first, 16, outputs, 0, ignore_eos=True))
    engine.submit(request(second, 10, outputs, 1, ignore_eos=True))
    engine.step()
    assert [s.request.prompt_ids for s in engine.running] == [first] and len(engine.waiting) == 1
    run_until_idle(engine)
    assert outputs[1][-1].completion_tokens == 10
    assert tokens(outputs[1]) == generate(model, [second], max_new_tokens=10)[0]


def test_requests_past_the_context_are_rejected_and_a_full_queue_refuses(model, tokenizer):
    engine = engine_for(model, tokenizer, max_waiting=1)
    with pytest.raises(RequestRejected, match="maximum context length is 128"):
        engine.submit(GenerationRequest(list(range(2, 100)), 40))
    engine.submit(GenerationRequest([5, 6], 4))
    with pytest.raises(QueueFull):
        engine.submit(GenerationRequest([5, 6], 4))


def test_an_aborted_request_frees_its_blocks_and_the_others_continue(model, tokenizer):
    engine, outputs = engine_for(model, tokenizer), {}
    prompts = random_prompts([12, 12], seed=7)
    requests = [request(p, 20, outputs, i, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in requests:
        engine.submit(r)
    engine.step()
    engine.step()
    engine.abort(requests[0].id)
    engine.step()
    assert outputs[0][-1].finish_reason == "abort" and len(engine.running) == 1
    assert engine.metrics.registry.get_sample_value("llmstack_kv_cache_slots_used") == 1
    run_until_idle(engine)  # the survivor moved from slot 1 into slot 0 and decodes on
    assert tokens(outputs[1]) == generate(model, [prompts[1]], max_new_tokens=20)[0]
    assert engine.metrics.registry.get_sample_value("llmstack_kv_cache_slots_used") == 0


def test_a_failing_step_ends_its_requests_with_an_error_and_the_engine_serves_on(model, tokenizer, monkeypatch):
    engine, outputs = engine_for(model, tokenizer), {}
    engine.submit(request([5, 6, 7], 4, outputs, 0))
    real_forward = model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(model, "forward", broken)
    engine.step()
    assert outputs[0][-1].finish_reason == "error" and "out of memory" in outputs[0][-1].error
    assert not engine.running
    monkeypatch.setattr(model, "forward", real_forward)
    engine.submit(request([5, 6, 7], 4, outputs, 1))
    run_until_idle(engine)
    assert outputs[1][-1].finish_reason in ("length", "stop")


def test_a_budget_too_small_for_one_context_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="one KV cache slot"):
        build_engine(model, tokenizer, kv_cache_mb=0.01)


def test_a_burst_of_prompts_is_admitted_within_the_prefill_budget_without_chunking(model, tokenizer):
    engine, outputs = engine_for(model, tokenizer, max_prefill_tokens=50, chunked_prefill_size=0), {}
    for i, prompt in enumerate(random_prompts([30, 15, 10, 60, 5], seed=8)):
        engine.submit(request(prompt, 4, outputs, i, ignore_eos=True))
    admitted = []
    while engine.waiting:
        before = len(engine.waiting)
        engine.step()
        admitted.append(before - len(engine.waiting))
    assert admitted == [2, 1, 1, 1]  # 30+15; 10 (+60 > 50); 60 alone (over the budget, but admitted); 5
    run_until_idle(engine)
    assert all(outputs[i][-1].completion_tokens == 4 for i in range(5))
