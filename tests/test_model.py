"""The model: HF save/load, Llama export/import, loss options, architecture options, KV cache."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llmstack import LLMStackConfig, LLMStackForCausalLM, from_llama, to_llama


def make_model(config, seed=0):
    torch.manual_seed(seed)
    return LLMStackForCausalLM(config).eval()


def test_save_pretrained_round_trip_through_auto_classes(tmp_path, tiny_config):
    model = make_model(tiny_config)
    ids = torch.randint(0, 128, (2, 12))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, LLMStackForCausalLM)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_llama_export_loads_in_stock_transformers_with_equal_logits(tmp_path, tiny_config):
    model = make_model(tiny_config)
    to_llama(model).save_pretrained(tmp_path)
    llama = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 16))
    assert (llama(ids).logits - model(ids).logits).abs().max() < 1e-5


def test_llama_import_round_trip(tiny_config):
    model = make_model(tiny_config)
    back = from_llama(to_llama(model)).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert back.config.num_key_value_heads == tiny_config.num_key_value_heads


def test_post_ln_and_gelu_models_refuse_llama_export(tiny_config):
    model = make_model(LLMStackConfig(**{**tiny_config.to_dict(), "norm_position": "post", "activation": "gelu"}))
    with pytest.raises(ValueError, match="llama equivalent"):
        to_llama(model)


@pytest.mark.parametrize("options", [{"norm_position": "post"}, {"activation": "gelu"}, {"init_method": "xavier"}])
def test_architecture_options_train(tiny_config, options):
    model = make_model(LLMStackConfig(**{**tiny_config.to_dict(), **options})).train()
    ids = torch.randint(0, 128, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8


def test_scaled_init_shrinks_residual_projections():
    config = LLMStackConfig(
        vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4
    )
    model = make_model(config)
    q_std = model.model.layers[0].self_attn.q_proj.weight.std().item()
    o_std = model.model.layers[0].self_attn.o_proj.weight.std().item()
    assert q_std == pytest.approx(0.02, rel=0.05)
    assert o_std == pytest.approx(0.02 / 4, rel=0.05)  # 1 / sqrt(2 * 8 layers)


def test_loss_label_smoothing_z_loss_and_ignore_index(tiny_config):
    ids = torch.randint(0, 128, (2, 10))
    labels = ids.clone()
    labels[0, :4] = -100
    model = make_model(LLMStackConfig(**{**tiny_config.to_dict(), "label_smoothing": 0.1, "z_loss": 1e-3}))
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].float().reshape(-1, 128)
    targets = labels[:, 1:].reshape(-1)
    valid = targets != -100
    expected = F.cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.1)
    expected = expected + 1e-3 * torch.logsumexp(logits[valid], -1).pow(2).mean()
    torch.testing.assert_close(out.loss, expected)
    # shift_labels (the trainer's pre-shifted targets) give the same loss as HF-style labels
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    torch.testing.assert_close(model(ids, shift_labels=shifted).loss, out.loss)
    # in training the loss comes from the hidden states, a chunk at a time, and no logits are returned
    trained = model.train()(ids, labels=labels)
    assert trained.logits is None
    torch.testing.assert_close(trained.loss, out.loss)


def test_kv_cache_matches_full_recomputation_with_left_padding(tiny_config):
    model = make_model(tiny_config)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    out_hf = model.generate(
        torch.tensor([[0, 0, 0, 11, 12], prompts[0]][::-1]),
        attention_mask=torch.tensor([[1] * 5, [0, 0, 0, 1, 1]]),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert out_hf[row, -6:].tolist() == ids[0, -6:].tolist()


def test_invalid_head_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible"):
        LLMStackConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="norm_position"):
        LLMStackConfig(norm_position="sandwich")
