"""Tiled MLPs (train.tiled_mlp_tokens): the MLP's output and every gradient equal the untiled
MLP's, alone, in the model with and without activation checkpointing, and in the trainer.

Measured (fp32, tiny model: hidden 32, FFN 64, 2 samples of 300 tokens, tiles of 100), largest
difference over seeds 0-3 (SwiGLU, whose tiles take the hand-written backward: seeds 0-11),
relative to the largest element of the untiled gradients:
    the MLP alone (random output gradient): output 3.5e-10 (SwiGLU) / 3.7e-9 (GELU) absolute;
        gradients 3.8e-7 to 6.7e-7 (SwiGLU) / 5.3e-7 (GELU: 3.3e-6 of 6.3)
    the model's loss: bit-equal; its gradients 1.5e-8 to 3.2e-8 (SwiGLU) / 2.6e-7 (GELU), with and
        without activation checkpointing
The tiles only reorder the sums of the weight gradients over tokens, hence the relative bound 1e-6.
"""

import copy

import pytest
import torch
from conftest import TINY_MODEL

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.moe import MoEBlock
from llmstack.parallel.layout import Layout, check_layout
from llmstack.training.tiled_mlp import tile_mlps

TOLERANCE = 1e-6  # relative to the largest gradient element; outputs and losses absolute
TILE = 100


def model(seed, **config):
    torch.manual_seed(seed)
    return LLMStackForCausalLM(LLMStackConfig(vocab_size=128, **TINY_MODEL, **config)).train()


def loss_and_gradients(m, tokens):
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=tokens[:, :-1], shift_labels=tokens[:, 1:]).loss
    loss.backward()
    return loss.item(), [p.grad for p in m.parameters()]


def largest_difference(expected, found):
    """The largest elementwise difference of two lists of tensors, relative to expected's largest element."""
    scale = max(t.abs().max().item() for t in expected)
    return max((a - b).abs().max().item() for a, b in zip(expected, found, strict=True)) / scale


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_a_tiled_mlp_computes_the_untiled_output_and_gradients(activation):
    whole = model(0, activation=activation)
    tiled_model = copy.deepcopy(whole)
    tile_mlps(tiled_model, TILE)
    reference, tiled = whole.model.layers[0].mlp, tiled_model.model.layers[0].mlp
    x = torch.randn(2, 301, TINY_MODEL["hidden_size"], requires_grad=True)
    grad = torch.randn_like(x)
    outputs = [mlp(x) for mlp in (reference, tiled)]
    assert (outputs[0] - outputs[1]).abs().max() < TOLERANCE
    grads = [torch.autograd.grad(out, (x, *mlp.parameters()), grad) for out, mlp in zip(outputs, (reference, tiled))]
    assert largest_difference(*grads) < TOLERANCE


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_a_model_with_tiled_mlps_trains_as_the_untiled_one(checkpointing):
    reference = model(0)
    tiled = copy.deepcopy(reference)
    assert tile_mlps(tiled, TILE) == TINY_MODEL["num_hidden_layers"]
    if checkpointing:
        tiled.activation_checkpointing_enable()
    tokens = torch.randint(0, 128, (2, 301), generator=torch.Generator().manual_seed(0))
    (loss, grads), (tiled_loss, tiled_grads) = (loss_and_gradients(m, tokens) for m in (reference, tiled))
    assert abs(loss - tiled_loss) < TOLERANCE
    assert largest_difference(grads, tiled_grads) < TOLERANCE
    assert set(dict(tiled.named_parameters())) == set(dict(reference.named_parameters()))  # names unchanged


def test_moe_blocks_stay_whole_and_the_layout_refuses_what_tiling_does_not_support(tmp_path):
    from conftest import tiny_run_config

    from llmstack.training.config import parse_run_config, run_layout

    raw = tiny_run_config({"tokenizer": "tok", "train": ["data"]}, tmp_path, tiled_mlp_tokens=-1)
    with pytest.raises(UserError, match="train.tiled_mlp_tokens must be 0"):
        parse_run_config(raw)
    raw["train"]["tiled_mlp_tokens"] = TILE
    assert run_layout(parse_run_config(raw), {}).tiled_mlp_tokens == TILE
    moe = model(0, num_local_experts=4, num_experts_per_tok=2)
    assert tile_mlps(moe, TILE) == 0
    assert all(isinstance(layer.mlp, MoEBlock) and "forward" not in vars(layer.mlp) for layer in moe.model.layers)
    with pytest.raises(ValueError, match="at least one token"):
        tile_mlps(model(0), 0)
    check_layout(Layout(context=2, zero_stage=2, activation_checkpointing=True, tiled_mlp_tokens=TILE))
    for layout, rule in (
        (Layout(zero_stage=3, tiled_mlp_tokens=TILE), "tiled MLP with ZeRO stage 3"),
        (Layout(model="moe", tiled_mlp_tokens=TILE), "tiled MLP with a mixture-of-experts model"),
        (Layout(tensor=2, tiled_mlp_tokens=TILE), "tiled MLP with tensor or pipeline parallelism"),
        (Layout(compile=True, tiled_mlp_tokens=TILE), "tiled MLP compiled"),
    ):
        with pytest.raises(UserError, match=rule):
            check_layout(layout)


def test_the_trainer_with_tiled_mlps_logs_the_untiled_losses(tmp_path, tiny_data):
    """4 steps of 4 samples of 64 tokens at ZeRO-2 with context parallelism 2 and activation
    checkpointing, MLP tiles of 48 tokens (a rank's 4 x 32 tokens: 3 tiles), then a validation
    pass: the losses of the same run untiled. Measured over seeds 0-2: training losses within
    2.4e-7, validation losses within 4.8e-7 (one fp32 step of a loss of about 5.5)."""
    import json

    from conftest import tiny_run_config
    from test_context_parallel import train_runs

    from llmstack.testing import run_distributed

    ds_path = tmp_path / "zero2.json"
    ds_path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    runs = {}
    for name, tile in (("untiled", 0), ("tiled", 48)):
        raw = tiny_run_config(
            tiny_data, tmp_path / name, max_steps=4, context_parallel_size=2, activation_checkpointing=True
        )
        raw["data"]["seq_len"] = 64
        raw["train"].update(eval_interval=4, eval_samples=4)
        raw["train"]["tiled_mlp_tokens"] = tile
        runs[name] = (raw, str(ds_path))
    found = run_distributed(train_runs, 2, args=(runs,))[0]
    assert "tiled MLP (48 tokens)" in found["tiled"][2]
    untiled, tiled = found["untiled"][0], found["tiled"][0]
    assert len(tiled) == 4
    assert max(abs(a - b) for a, b in zip(untiled, tiled, strict=True)) < 1e-6, (untiled, tiled)
    assert abs(found["untiled"][1] - found["tiled"][1]) < 1e-6
