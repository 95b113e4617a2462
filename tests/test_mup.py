"""µP (model.mup_base_width): the coordinate check, the per-parameter rules, the learning rate of
each optimizer group through the schedule under ZeRO, m = 1 as standard parametrisation, export."""

import pytest
import torch
from conftest import TINY_MODEL, tiny_run_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llmstack import LLMStackConfig, LLMStackForCausalLM, to_llama
from llmstack.errors import UserError
from llmstack.models.mup import lr_scale, width_multiplier
from llmstack.testing import run_distributed
from llmstack.training.construct import build_model_config
from llmstack.training.export import export_hf
from llmstack.training.schedule import lr_at
from llmstack.training.trainer import param_groups

COORD_WIDTHS = (64, 128, 256, 512, 1024)
COORD_VOCAB, COORD_SEQ = 256, 16


def coord_config(width: int, base: int | None, **fields) -> LLMStackConfig:
    """The coordinate check's models: the number of heads fixed, so heads widen with the model."""
    return LLMStackConfig(
        vocab_size=COORD_VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=COORD_SEQ,
        mup_base_width=base,
        **fields,
    )


def logit_change(width: int, base: int | None, seed: int, steps: int = 4, lr: float = 1e-3) -> float:
    """Mean |logits after `steps` AdamW steps - logits at init| on one fixed batch: the size of a
    logit coordinate's update, which µP keeps independent of width."""
    torch.manual_seed(seed)
    model = LLMStackForCausalLM(coord_config(width, base))
    data = torch.randint(0, COORD_VOCAB, (4, COORD_SEQ + 1), generator=torch.Generator().manual_seed(1000 + seed))
    inputs, targets = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(param_groups(model, 0.0, lr), lr=lr, betas=(0.9, 0.95))
    with torch.no_grad():
        before = model.eval()(inputs).logits
    model.train()
    for _ in range(steps):
        model(inputs, shift_labels=targets).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return (model.eval()(inputs).logits - before).abs().mean().item()


@pytest.fixture
def one_thread():
    """Small models on one thread: on a loaded 2-core machine 2 threads were 6x slower here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_coordinate_check_flat_under_mup_growing_under_standard_parametrisation(one_thread):
    mup = [logit_change(w, COORD_WIDTHS[0], seed=0) for w in COORD_WIDTHS]
    standard = [logit_change(w, None, seed=0) for w in COORD_WIDTHS]
    assert mup[0] == standard[0]  # at the base width the two are one model
    # Widest over narrowest, seeds 0-7: µP 0.74-0.93, standard 5.98-6.85 (docs/mup.md).
    assert 0.6 < mup[-1] / mup[0] < 1.4
    assert standard[-1] / standard[0] > 3.5
    assert all(b > a for a, b in zip(standard, standard[1:]))  # growing at every doubling


def test_base_width_equal_to_hidden_size_is_standard_parametrisation(tiny_config):
    ids = torch.randint(0, 128, (2, 12))
    logits = {}
    for base in (None, tiny_config.hidden_size):
        torch.manual_seed(0)
        model = LLMStackForCausalLM(LLMStackConfig(**{**tiny_config.to_dict(), "mup_base_width": base})).eval()
        logits[base] = model(ids).logits
        assert len(param_groups(model, 0.1, lr=1e-3)) == 2  # no group of its own: every lr is the base one
    assert torch.equal(logits[None], logits[tiny_config.hidden_size])


def test_rules_per_parameter_kind():
    base, wide = coord_config(64, 64), coord_config(256, 64, num_local_experts=4, moe_intermediate_size=64)
    m = width_multiplier(wide)
    assert m == 4.0 and width_multiplier(coord_config(256, None)) == 1.0
    torch.manual_seed(0)
    small, large = LLMStackForCausalLM(base), LLMStackForCausalLM(wide)
    layer, big = small.model.layers[0], large.model.layers[0]
    std = small.config.initializer_range
    # Hidden weights' init variance goes as 1/m, the router's as 1/m^2; the tied embedding keeps its own.
    assert big.self_attn.q_proj.weight.std().item() == pytest.approx(std / m**0.5, rel=0.05)
    assert big.mlp.experts.gate_up_proj.std().item() == pytest.approx(std / m**0.5, rel=0.05)
    assert big.mlp.gate.weight.std().item() == pytest.approx(std / m, rel=0.1)
    assert large.lm_head.weight is large.model.embed_tokens.weight
    assert large.model.embed_tokens.weight.std().item() == pytest.approx(std, rel=0.05)
    # Output multiplier 1/m on the final norm, attention scores 1/sqrt(m) on top of 1/sqrt(head_dim).
    assert (small.model.norm.multiplier, large.model.norm.multiplier) == (1.0, 1 / m)
    assert (layer.self_attn.query_multiplier, big.self_attn.query_multiplier) == (1.0, m**-0.5)
    scales = {name: lr_scale(name, p.dim(), wide) for name, p in large.named_parameters()}
    assert scales["model.embed_tokens.weight"] == scales["model.norm.weight"] == 1.0
    assert scales["model.layers.0.input_layernorm.weight"] == 1.0
    for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.experts.down_proj"):
        assert scales[f"model.layers.0.{name}"] == 1 / m, name
    assert lr_scale("base_model.model.lm_head.weight", 2, wide) == 1.0  # the untied readout, under a wrapper
    groups = param_groups(large, 0.1, lr=1e-3)
    assert [(g["lr"], g["weight_decay"]) for g in groups if "lr" in g] == [(1e-3 / m, 0.1 * m)]


@pytest.mark.parametrize("base", [0, -64, 1.5, True, "64"])
def test_bad_base_width_is_one_clear_error(base, tiny_data):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="mup_base_width must be a positive integer"):
        LLMStackConfig(mup_base_width=base)
    tokenizer = AutoTokenizer.from_pretrained(tiny_data["tokenizer"])
    with pytest.raises(UserError, match="model section: mup_base_width"):
        build_model_config({**TINY_MODEL, "mup_base_width": base}, tokenizer, 32)


def test_xavier_init_is_refused():
    with pytest.raises(ValueError, match="init_method scaled_normal"):
        LLMStackConfig(mup_base_width=64, init_method="xavier")


def test_export_keeps_mup_in_llmstack_format_and_refuses_stock_families(tmp_path, tiny_config):
    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**{**tiny_config.to_dict(), "mup_base_width": 16})).eval()
    ids = torch.randint(0, 128, (2, 12))
    model.save_pretrained(tmp_path / "mup")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mup")
    assert loaded.config.mup_base_width == 16
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no µP output and attention multipliers.*--format llmstack"):
        to_llama(model)
    with pytest.raises(UserError, match="width multiplier 2"):
        export_hf(str(tmp_path / "mup"), str(tmp_path / "llama"), fmt="llama")
    # m = 1 computes what standard parametrisation does: a stock Llama holds it.
    same = LLMStackForCausalLM(LLMStackConfig(**{**tiny_config.to_dict(), "mup_base_width": 32})).eval()
    to_llama(same).save_pretrained(tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    assert (llama(ids).logits - same(ids).logits).abs().max() < 1e-5


def group_lrs_per_step(rank, world_size, raw_by_name, steps):
    """{ds_config: [(lr, weight_decay) of each optimizer group, at each step]} of a µP run."""
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    seen = {}
    for name, raw in raw_by_name.items():
        trainer = Trainer(parse_run_config(raw), ds_config_path=f"ds_configs/{name}.json")
        batches = trainer.train_batches()
        seen[name] = []
        for _ in range(steps):
            seen[name].append([(g["lr"], g["weight_decay"]) for g in trainer.engine.optimizer.param_groups])
            trainer.train_step(batches)
        batches.close()
    return seen


def test_hidden_weights_lr_is_base_lr_over_m_at_every_step_under_zero(tmp_path, tiny_data):
    steps, lr, wd = 3, 3e-3, 0.1  # warmup at steps 0 and 1, cosine decay at step 2
    raw_by_name = {}
    for name in ("zero2", "zero3"):
        raw = tiny_run_config(tiny_data, tmp_path / name, max_steps=steps, warmup_steps=2, lr=lr, weight_decay=wd)
        raw["model"]["mup_base_width"] = 8  # hidden_size 32: m = 4
        raw_by_name[name] = raw
    # One rank: ZeRO-2/3 wrap the optimizer (and copy its groups) as on many, without a second process.
    seen = run_distributed(group_lrs_per_step, 1, args=(raw_by_name, steps))[0]
    for name, per_step in seen.items():
        for step, groups in enumerate(per_step):
            peak = lr_at(step, lr, 3e-5, 2, steps)
            expected = [(peak, wd), (peak, 0.0), (peak / 4, wd * 4)]
            assert groups == pytest.approx(expected, rel=1e-9), (name, step)
