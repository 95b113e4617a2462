import pytest
import torch
from inference_fixtures import random_prompts, tiny_model, tiny_tokenizer
from transformers import TextStreamer
from transformers.cache_utils import DynamicCache

from llmstack import to_llama
from llmstack.inference import SamplingParams, generate, generate_text
from llmstack.inference.generate import left_pad

LENGTHS = (3, 11, 7)  # different lengths, so the batch is left-padded
NEW = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def hf_greedy(hf_model, prompts):
    input_ids, attention_mask = left_pad(prompts, pad_token_id=1)
    out = hf_model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=1
    )
    return out[:, input_ids.shape[1] :].tolist()


def test_greedy_equals_transformers_generate(model):
    prompts = random_prompts(LENGTHS)
    ours = generate(model, prompts, max_new_tokens=NEW)
    assert ours == hf_greedy(model, prompts)
    assert len({tuple(c) for c in ours}) == len(ours) and all(len(set(c)) > 3 for c in ours)  # not degenerate


def test_exported_llama_generates_the_same_greedy_tokens_in_stock_transformers(model):
    prompts = random_prompts(LENGTHS, seed=1)
    assert hf_greedy(to_llama(model).eval(), prompts) == generate(model, prompts, max_new_tokens=NEW)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=40)])
def test_kv_cache_decoding_equals_full_recomputation(model, sampling):
    prompts = random_prompts(LENGTHS, seed=2)
    cached = generate(model, prompts, max_new_tokens=NEW, sampling=sampling, seed=5)
    assert cached == generate(model, prompts, max_new_tokens=NEW, sampling=sampling, seed=5, use_cache=False)
    if sampling.greedy:  # a padded batch decodes each prompt exactly as it decodes alone
        assert cached == [generate(model, [p], max_new_tokens=NEW)[0] for p in prompts]


def test_kv_cache_logits_equal_full_recomputation_logits(model):
    """Step by step, not just the argmax: last-position logits with the cache match a full forward."""
    input_ids, attention_mask = left_pad(random_prompts(LENGTHS, seed=3))
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    step_ids, step_pos = input_ids, positions
    with torch.no_grad():
        for _ in range(5):
            cached = model(step_ids, attention_mask=attention_mask, position_ids=step_pos, cache=cache, use_cache=True)
            full = model(input_ids, attention_mask=attention_mask, position_ids=positions)
            torch.testing.assert_close(cached.logits[:, -1], full.logits[:, -1], rtol=1e-5, atol=1e-5)
            token = full.logits[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, token], 1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], 1)
            positions = torch.cat([positions, positions[:, -1:] + 1], 1)
            step_ids, step_pos = token, positions[:, -1:]


def test_seeded_sampling_is_reproducible(model):
    prompts = random_prompts((5, 8), seed=4)
    sampling = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2)
    first = generate(model, prompts, max_new_tokens=NEW, sampling=sampling, seed=11)
    assert first == generate(model, prompts, max_new_tokens=NEW, sampling=sampling, seed=11)
    assert first != generate(model, prompts, max_new_tokens=NEW, sampling=sampling, seed=12)


def test_eos_ends_a_row_and_max_new_tokens_bounds_the_rest(model):
    prompts = random_prompts(LENGTHS, seed=5)
    free = generate(model, prompts, max_new_tokens=NEW)
    eos = free[0][4]
    stopped = generate(model, prompts, max_new_tokens=NEW, eos_token_id=eos)
    for full, cut in zip(free, stopped):
        expected = full[: full.index(eos)] if eos in full else full
        assert cut == expected
    assert all(len(c) == 6 for c in generate(model, prompts, max_new_tokens=6))


def test_stop_strings_cut_the_text_and_end_decoding(model, tokenizer):
    prompt = "def add(a, b):"
    free_ids = generate(model, [tokenizer(prompt)["input_ids"]], max_new_tokens=NEW, tokenizer=tokenizer)[0]
    free_text = tokenizer.decode(free_ids)
    stop = tokenizer.decode(free_ids[6:8])
    texts = generate_text(model, tokenizer, [prompt], max_new_tokens=NEW, stop_strings=[stop], eos_token_id=None)
    assert texts == [free_text[: free_text.index(stop)]]
    ids = generate(
        model, [tokenizer(prompt)["input_ids"]], max_new_tokens=NEW, stop_strings=[stop], tokenizer=tokenizer
    )
    assert stop in tokenizer.decode(ids[0]) and stop not in tokenizer.decode(ids[0][:-1])


def test_streamer_prints_the_completion_as_it_is_generated(model, tokenizer, capsys):
    prompt = "The quick brown"
    expected = generate_text(model, tokenizer, [prompt], max_new_tokens=NEW, eos_token_id=None)[0]
    capsys.readouterr()
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    generate_text(model, tokenizer, [prompt], max_new_tokens=NEW, eos_token_id=None, streamer=streamer)
    assert capsys.readouterr().out == expected + "\n"
