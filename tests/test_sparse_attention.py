"""BigBird block-sparse attention: blockwise equals dense attention under the pattern's mask, the
pattern's properties, and the decoder using it in training and KV-cache generation."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_run_config
from inference_fixtures import random_prompts, tiny_model, tiny_tokenizer

from llmstack import LLMStackConfig, to_llama
from llmstack.inference import generate
from llmstack.inference.serve.engine import Engine, GenerationRequest
from llmstack.inference.serve.kv_cache import CacheShape, SlotKVCache
from llmstack.models import LLMStackEncoderConfig, LLMStackForMaskedLM
from llmstack.models.encoder_interop import to_eurobert_config
from llmstack.models.sparse_attention import BigBirdPattern, sparse_attention
from llmstack.testing import run_distributed

BIGBIRD = dict(attention_pattern="bigbird", sparse_block_size=4, sparse_window_blocks=1, sparse_random_blocks=1)
TINY_ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def reference(q, k, v, pattern, key_padding_mask):
    """Dense SDPA under the pattern's mask, with attention_mask_4d's rule for padding (a query
    always reads its own key)."""
    seq = q.shape[2]
    mask = pattern.dense_mask(seq) & (key_padding_mask[:, None, :] | torch.eye(seq, dtype=torch.bool))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", [37, 40])  # a partial last block, and whole blocks
def test_blockwise_equals_dense_attention_under_the_patterns_mask(causal, seq):
    pattern = BigBirdPattern(4, window_blocks=1, global_blocks=2, random_blocks=2, causal=causal, seed=3, layer=1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, seq, 8, requires_grad=True) for _ in range(3))
    key_padding_mask = torch.ones(2, seq, dtype=torch.bool)
    key_padding_mask[1, seq - 9 :] = False  # right padding in one row
    out = sparse_attention(q, k, v, pattern, key_padding_mask)
    expected = reference(q, k, v, pattern, key_padding_mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_pattern_has_window_global_and_random_blocks_and_stays_sparse():
    w, g, r = 2, 1, 3
    causal = BigBirdPattern(4, w, g, r, causal=True).block_layout(40)
    assert causal.tril().equal(causal) and causal[:, :g].tril().equal(torch.ones(40, g, dtype=torch.bool).tril())
    for i in range(g + w + r, 40):
        assert causal[i, i - w : i + 1].all()
        assert int(causal[i].sum()) == g + w + 1 + r  # window, global and r random blocks, no more
    bidirectional = BigBirdPattern(4, w, g, r, causal=False).block_layout(40)
    assert bidirectional[:g].all() and bidirectional[:, :g].all()  # global blocks read and are read by all
    assert all(int(bidirectional[i].sum()) == g + 2 * w + 1 + r for i in range(g + w + 1, 40 - w))
    other_layer = BigBirdPattern(4, w, g, r, causal=True, layer=1).block_layout(40)
    assert not other_layer.equal(causal)  # random blocks are drawn per layer


def test_the_causal_pattern_of_a_block_does_not_depend_on_the_sequence_length():
    """What a KV-cache decode relies on: the mask of 20 blocks is the corner of the mask of 50."""
    pattern = BigBirdPattern(4, 1, 1, 2, causal=True)
    assert pattern.block_layout(50)[:20, :20].equal(pattern.block_layout(20))


def test_kv_cache_decoding_of_a_padded_batch_equals_full_recomputation_and_decoding_alone():
    model = tiny_model(**BIGBIRD)
    prompts = random_prompts((3, 14, 9), seed=2)  # left-padded; decoding crosses several blocks
    cached = generate(model, prompts, max_new_tokens=16)
    assert cached == generate(model, prompts, max_new_tokens=16, use_cache=False)
    assert cached == [generate(model, [p], max_new_tokens=16)[0] for p in prompts]
    assert cached != generate(tiny_model(), prompts, max_new_tokens=16)  # the pattern changes what is read


def test_the_serving_engines_slotted_cache_decodes_as_generate_alone(tmp_path):
    """Sequences in a batch of slots leave gaps between their keys and the new token's column."""
    tokenizer = tiny_tokenizer(tmp_path)
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=64, **BIGBIRD)
    engine = Engine(model, tokenizer, SlotKVCache(CacheShape.of(model), 4, 64))
    prompts, outputs = random_prompts((5, 17, 10), seed=4), {}
    for i, prompt in enumerate(prompts):
        engine.submit(
            GenerationRequest(prompt, 14, on_event=lambda e, i=i: outputs.setdefault(i, []).extend(e.token_ids))
        )
        engine.step()  # later prompts join a batch already decoding
    while engine.waiting or engine.running:
        engine.step()
    eos = tokenizer.eos_token_id
    assert [outputs[i] for i in range(3)] == [
        generate(model, [p], max_new_tokens=14, eos_token_id=eos)[0] for p in prompts
    ]


def test_the_decoders_logits_equal_its_layers_under_the_dense_mask():
    """The model's blockwise forward against the same weights reading the pattern's dense mask."""
    sparse = tiny_model(**BIGBIRD)
    ids = torch.randint(2, 320, (2, 30))
    with torch.no_grad():
        logits = sparse(input_ids=ids).logits
        for layer in sparse.model.layers:
            dense_mask = layer.self_attn.sparse_pattern.dense_mask(30)
            layer.self_attn.sparse_pattern = None
            layer.self_attn.forward = _with_mask(layer.self_attn.forward, dense_mask)
        torch.testing.assert_close(sparse(input_ids=ids).logits, logits, atol=1e-5, rtol=0)


def _with_mask(forward, mask):
    def call(x, cos, sin, attn_mask=None, cache=None):
        return forward(x, cos, sin, mask if mask.dim() == 4 else mask[None, None], cache)

    return call


def test_the_encoders_logits_equal_its_layers_under_the_bidirectional_dense_mask():
    """A masked-LM encoder runs the bidirectional pattern (global blocks read everything), with
    right padding: its real positions' logits equal dense attention under the pattern's mask."""
    torch.manual_seed(0)
    config = LLMStackEncoderConfig(mask_token_id=1, vocab_size=320, num_key_value_heads=2, **TINY_ENCODER, **BIGBIRD)
    encoder = LLMStackForMaskedLM(config).eval()
    ids = torch.randint(2, 320, (2, 30))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 23:] = 0
    with torch.no_grad():
        logits = encoder(input_ids=ids, attention_mask=attention_mask).logits
        real = attention_mask[:, None, :].bool() | torch.eye(30, dtype=torch.bool)
        for layer in encoder.model.layers:
            assert not layer.self_attn.sparse_pattern.causal
            dense_mask = layer.self_attn.sparse_pattern.dense_mask(30) & real
            layer.self_attn.sparse_pattern = None
            layer.self_attn.forward = _with_mask(layer.self_attn.forward, dense_mask[:, None])
        dense = encoder(input_ids=ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    torch.testing.assert_close(logits[keep], dense[keep], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="eurobert has no sparse attention"):
        to_eurobert_config(config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"attention_pattern": "sparse"}, "attention_pattern must be one of dense, bigbird"),
        ({**BIGBIRD, "sparse_block_size": 0}, "sparse_block_size must be at least 1"),
        ({**BIGBIRD, "sparse_random_blocks": -1}, "sparse_random_blocks must be 0 or more"),
        ({**BIGBIRD, "sliding_window": 8}, "leave sliding_window unset"),
    ],
)
def test_bad_sparse_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LLMStackConfig(**fields)


def test_a_bigbird_model_refuses_export_to_a_dense_family():
    with pytest.raises(ValueError, match="no sparse attention"):
        to_llama(tiny_model(**BIGBIRD))


def train_bigbird(rank, world_size, raw):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    Trainer(parse_run_config(raw), ds_config_path="ds_configs/zero1.json").train()


def test_the_trainer_trains_a_bigbird_model_with_activation_checkpointing(tmp_path, tiny_data):
    raw = tiny_run_config(tiny_data, tmp_path, activation_checkpointing=True, max_steps=4)
    raw["model"].update(BIGBIRD)
    run_distributed(train_bigbird, world_size=1, args=(raw,))
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    saved = json.loads(next(tmp_path.glob("checkpoints/**/config.json")).read_text())
    assert saved["attention_pattern"] == "bigbird" and saved["sparse_block_size"] == 4
