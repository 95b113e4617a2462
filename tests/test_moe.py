"""The mixture-of-experts layer (llmstack.models.moe) against hand computations: routing, expert
outputs, the load-balancing and z losses, capacity dropping, and how the model adds them to its loss."""

import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.loss import causal_lm_loss
from llmstack.models.modeling_llmstack import SwiGLU
from llmstack.models.moe import MoEBlock, RouterRecord, load_balancing_loss

TOLERANCE = 1e-5  # fp32 against Python floats, outputs up to ~10: measured differences <= 1.9e-6 (5 seeds)


def moe_config(**overrides):
    fields = dict(
        vocab_size=64,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return LLMStackConfig(**{**fields, **overrides})


def random_block(config, seed=0):
    torch.manual_seed(seed)
    shared = SwiGLU(config, config.moe_shared_intermediate_size) if config.moe_shared_intermediate_size else None
    block = MoEBlock(config, shared)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block


def expert_by_hand(block, e, x):
    gate_up, down = block.experts.gate_up_proj[e], block.experts.down_proj[e]
    gate, up = gate_up[: gate_up.shape[0] // 2], gate_up[gate_up.shape[0] // 2 :]
    return down @ (F.silu(gate @ x) * (up @ x))


@torch.no_grad()
def test_routing_output_and_losses_match_a_hand_computation():
    config = moe_config()
    block = random_block(config)
    x = torch.randn(2, 5, config.hidden_size)
    record = RouterRecord()
    out = block(x, record)
    tokens = x.reshape(-1, config.hidden_size)
    router = block.gate.weight
    counts, prob_sums, log_z_squares = [0.0] * 4, torch.zeros(4), []
    for t, token in enumerate(tokens):
        logits = [float(router[e] @ token) for e in range(4)]
        z = sum(math.exp(v) for v in logits)
        probs = [math.exp(v) / z for v in logits]
        top = sorted(range(4), key=lambda e: -probs[e])[:2]
        expected = sum(probs[e] / (probs[top[0]] + probs[top[1]]) * expert_by_hand(block, e, token) for e in top)
        assert (out.reshape(-1, config.hidden_size)[t] - expected).abs().max() <= TOLERANCE
        for e in top:
            counts[e] += 1
        prob_sums += torch.tensor(probs)
        log_z_squares.append(math.log(z) ** 2)
    n = len(tokens)
    (stats,) = record.stats
    assert stats.load.tolist() == pytest.approx([c / (2 * n) for c in counts])
    assert float(stats.aux_loss) == pytest.approx(4 * sum(counts[e] / n * float(prob_sums[e]) / n for e in range(4)))
    assert float(stats.z_loss) == pytest.approx(sum(log_z_squares) / n)
    assert int(stats.dropped) == 0


def test_load_balancing_loss_is_transformers_mixtral_loss_for_one_layer():
    logits = torch.randn(30, 8)
    experts = logits.topk(2, dim=-1).indices
    ours = load_balancing_loss(logits.softmax(-1), experts)
    assert float(ours) == pytest.approx(float(load_balancing_loss_func((logits,), 8, 2)), abs=TOLERANCE)


def test_capacity_drops_later_tokens_in_training_only():
    config = moe_config(num_experts_per_tok=1, moe_capacity_factor=1.0)
    block = random_block(config)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[0] = 1.0  # every token with a positive sum prefers expert 0
    x = torch.rand(1, 8, config.hidden_size)  # positive: all 8 tokens choose expert 0; capacity 8 x 1 / 4 = 2
    training, evaluation = RouterRecord(), RouterRecord()
    out = block.train()(x, training)[0]
    assert int(training.stats[0].dropped) == 6
    assert out[2:].abs().max() == 0  # dropped tokens add nothing (the residual carries them)
    assert (out[:2] - block.eval()(x, evaluation)[0, :2]).abs().max() <= TOLERANCE
    assert int(evaluation.stats[0].dropped) == 0  # dropless in evaluation
    assert evaluation.stats[0].load.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_shared_expert_is_added_and_moe_layers_choose_the_blocks():
    config = moe_config(moe_shared_intermediate_size=6, moe_norm_topk_prob=False)
    block = random_block(config)
    x = torch.randn(1, 3, config.hidden_size)
    shared = block.shared_experts(x)
    block.shared_experts = None
    assert (random_block(config)(x) - (block(x) + shared)).abs().max() <= TOLERANCE
    model = LLMStackForCausalLM(moe_config(moe_layers=[1]))
    assert isinstance(model.model.layers[0].mlp, SwiGLU) and isinstance(model.model.layers[1].mlp, MoEBlock)


def test_model_loss_adds_weighted_aux_and_z_losses_and_trains_the_router():
    config = moe_config(router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    torch.manual_seed(0)
    model = LLMStackForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    out = model(ids, labels=ids)
    layers = out.router_stats
    assert len(layers) == 2
    aux = (layers[0].aux_loss + layers[1].aux_loss) / 2
    z = (layers[0].z_loss + layers[1].z_loss) / 2
    logits = model.lm_head(model.model(ids))  # training returns no logits (the loss is chunked)
    lm = causal_lm_loss(logits, F.pad(ids[:, 1:], (0, 1), value=-100))
    assert float(out.loss) == pytest.approx(float(lm + 0.1 * aux + 0.01 * z), abs=TOLERANCE)
    assert float(out.aux_loss) == pytest.approx(float(aux))
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    dense = LLMStackForCausalLM(moe_config(num_local_experts=0))
    assert not hasattr(dense(ids, labels=ids), "router_stats")


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"moe_layers": [2]}, "moe_layers"),
        ({"moe_capacity_factor": 0.0}, "moe_capacity_factor"),
    ],
)
def test_bad_moe_config_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        moe_config(**fields)


def test_moe_run_config_matches_the_quickstart_model_in_active_parameters():
    with open("configs/moe.yaml") as f:
        moe = yaml.safe_load(f)["model"]
    with open("configs/quickstart.yaml") as f:
        dense = yaml.safe_load(f)["model"]
    config = LLMStackConfig(**moe)
    assert {k: moe[k] for k in dense} == dense  # the quickstart model, MLPs aside
    active = config.num_experts_per_tok * config.moe_intermediate_size
    assert config.num_local_experts == 8 and active == dense["intermediate_size"]
