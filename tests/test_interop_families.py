"""Llama, Mistral and Qwen2 interchange: a small random stock transformers model is imported with
`llmstack import-hf` (same logits), trained one step, exported with `llmstack export-hf --format
FAMILY`, and reloaded with the stock class in a Python process that never imports llmstack (same
logits as the trained llmstack model). Config features llmstack lacks are refused by name."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from llmstack.cli.main import main
from llmstack.models import LLMStackConfig, LLMStackForCausalLM, from_hf_config, to_hf_config

# Sequences longer than the (original) context, so dynamic/yarn/llama3 scaling and the sliding
# window all change the result.
SEQ_LEN = 40
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0},
}
TOLERANCE = 1e-5  # the Done-when bound; measured differences are 0.0 for every variant (fp32, CPU)

STOCK_LOGITS = """
import json, sys
import torch
import transformers
dirs, cls, ids = json.loads(sys.argv[1])
out = {}
for d in dirs:
    model = getattr(transformers, cls).from_pretrained(d).eval()
    with torch.no_grad():
        out[d] = model(torch.tensor(ids)).logits.tolist()
assert not any(m == "llmstack" or m.startswith("llmstack.") for m in sys.modules)
print(json.dumps(out))
"""


def stock_logits_elsewhere(dirs, class_name, ids):
    """{dir: logits} from the stock class, computed in a fresh Python process without llmstack."""
    arg = json.dumps([[str(d) for d in dirs], class_name, ids.tolist()])
    done = subprocess.run([sys.executable, "-c", STOCK_LOGITS, arg], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return {d: torch.tensor(v) for d, v in json.loads(done.stdout.splitlines()[-1]).items()}


def random_stock_model(model_class, config, seed=0):
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # random biases and norm gains too, not zeros and ones
            param.normal_(0.0, 0.1)
    return model


def import_train_export(tmp_path, name, stock, family, ids):
    """Save `stock`, import it, check logits, train one step, export; returns (export dir, trained logits)."""
    hf_dir, ours_dir, trained_dir, out_dir = (tmp_path / f"{name}-{s}" for s in ("hf", "llmstack", "trained", "out"))
    stock.save_pretrained(hf_dir)
    assert main(["import-hf", str(hf_dir), str(ours_dir)]) in (0, None)
    model = LLMStackForCausalLM.from_pretrained(ours_dir).eval()
    with torch.no_grad():
        assert (model(ids).logits - stock(ids).logits).abs().max() <= TOLERANCE, name
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval().save_pretrained(trained_dir)
    assert main(["export-hf", str(trained_dir), str(out_dir), "--format", family]) in (0, None)
    with torch.no_grad():
        return out_dir, model(ids).logits


def check_round_trip(tmp_path, family, class_name, stock_by_name):
    ids = torch.randint(0, BASE["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    expected = {}
    for name, stock in stock_by_name.items():
        out_dir, logits = import_train_export(tmp_path, name, stock, family, ids)
        expected[str(out_dir)] = (name, logits)
    for out_dir, logits in stock_logits_elsewhere(list(expected), class_name, ids).items():
        name, ours = expected[out_dir]
        assert (logits - ours).abs().max() <= TOLERANCE, name


def test_llama_every_rope_scaling_tied_and_untied(tmp_path):
    stock = {
        f"{rope}-{'tied' if tied else 'untied'}": random_stock_model(
            LlamaForCausalLM, LlamaConfig(**BASE, rope_parameters=dict(params), tie_word_embeddings=tied)
        )
        for rope, params in ROPE.items()
        for tied in ((False, True) if rope == "default" else (False,))
    }
    check_round_trip(tmp_path, "llama", "LlamaForCausalLM", stock)


def test_mistral_sliding_window(tmp_path):
    config = MistralConfig(**BASE, sliding_window=8, head_dim=16)  # head_dim != hidden / heads
    check_round_trip(
        tmp_path, "mistral", "MistralForCausalLM", {"mistral": random_stock_model(MistralForCausalLM, config)}
    )


def test_qwen2_qkv_bias_and_sliding_layers(tmp_path):
    config = Qwen2Config(**BASE, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    stock = random_stock_model(Qwen2ForCausalLM, config)
    assert stock.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    check_round_trip(tmp_path, "qwen2", "Qwen2ForCausalLM", {"qwen2": stock})


def test_sliding_window_and_rope_scaling_change_what_is_compared():
    """The comparisons above would be vacuous if these features did nothing at SEQ_LEN."""
    x, positions = torch.zeros(1), torch.arange(SEQ_LEN).unsqueeze(0)
    plain = LLMStackForCausalLM(LLMStackConfig(**BASE)).eval()
    plain_cos, _ = plain.model.rotary_emb(x, positions)
    for params in ROPE.values():
        if params["rope_type"] != "default":
            cos, _ = LLMStackForCausalLM(LLMStackConfig(**BASE, rope_parameters=params)).model.rotary_emb(x, positions)
            assert (cos - plain_cos).abs().max() > 1e-2, params
    sliding = LLMStackForCausalLM(LLMStackConfig(**BASE, sliding_window=8)).eval()
    sliding.load_state_dict(plain.state_dict())
    ids = torch.randint(0, BASE["vocab_size"], (1, SEQ_LEN))
    with torch.no_grad():
        same = (sliding(ids).logits - plain(ids).logits).abs().amax(dim=-1)[0]
    assert same[:8].max() == 0 and same[8:].min() > 0  # only queries with more than 8 keys differ


def test_sliding_window_with_padding_and_kv_cache_matches_mistral():
    stock = random_stock_model(MistralForCausalLM, MistralConfig(**BASE, sliding_window=6))
    from llmstack.models import from_hf

    ours = from_hf(stock).eval()
    ids = torch.randint(0, BASE["vocab_size"], (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with torch.no_grad():
        expected = stock(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert (expected - got)[mask.bool()].abs().max() <= TOLERANCE
    # Decoding with a KV cache longer than the window sees what a full recomputation sees.
    with torch.no_grad():
        prefix = ours(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        last = ours(ids[:, -1:], attention_mask=mask, cache=prefix.cache).logits[:, -1]
    assert (last - got[:, -1]).abs().max() <= TOLERANCE


@pytest.mark.parametrize(
    "config_class, fields, named",
    [
        (LlamaConfig, {"attention_bias": True}, "attention_bias=True"),
        (LlamaConfig, {"mlp_bias": True}, "mlp_bias=True"),
        (LlamaConfig, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            LlamaConfig,
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 4,
                    "long_factor": [1.0] * 4,
                    "rope_theta": 1e4,
                }
            },
            "longrope",
        ),
        (
            LlamaConfig,
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        (LlamaConfig, {"an_unknown_feature": 3}, "an_unknown_feature=3"),
    ],
)
def test_unsupported_features_are_refused_by_name(tmp_path, capsys, config_class, fields, named):
    with pytest.raises(ValueError, match=named):
        from_hf_config(config_class(**BASE, **fields))
    stock = LlamaForCausalLM(LlamaConfig(**BASE))
    stock.config.update(fields)
    stock.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) != 0
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_export_refuses_what_the_family_cannot_express(family):
    layers = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding_window"):
        to_hf_config(LLMStackConfig(**BASE, sliding_window=4, layer_types=layers), family)
    with pytest.raises(ValueError, match="qkv_bias"):
        to_hf_config(LLMStackConfig(**BASE, qkv_bias=True), family)
