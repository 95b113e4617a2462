"""train.compile: compiled decoder blocks train to the eager losses (1e-5) without ZeRO, under
ZeRO-3's parameter hooks, with activation checkpointing (ZeRO-1/2 partition only the optimizer,
which compile does not see; each compiled run costs tens of seconds, so they are left out), and
with tensor or pipeline parallelism on 2 ranks."""

import json

import pytest
from conftest import tiny_run_config

from llmstack.testing import run_distributed
from llmstack.training.config import parse_run_config

ZERO0 = {"zero_optimization": {"stage": 0}}
ZERO1 = "ds_configs/zero1.json"


def losses_by_run(rank, world_size, runs):
    from torch._dynamo.utils import counters

    from llmstack.training import Trainer

    losses = {}
    for name, (raw, ds_config) in runs.items():
        Trainer(parse_run_config(raw), ds_config_path=ds_config).train()
        with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
            losses[name] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    losses["compiled graphs"] = counters["stats"]["unique_graphs"]
    return losses


def test_compiled_blocks_train_to_the_eager_losses(tmp_path, tiny_data):
    (tmp_path / "zero0.json").write_text(json.dumps(ZERO0))
    stages = {0: str(tmp_path / "zero0.json"), 2: "ds_configs/zero2.json", 3: "ds_configs/zero3.json"}
    runs = {"eager": (tiny_run_config(tiny_data, tmp_path / "eager", max_steps=3), stages[2])}
    for stage in (0, 3):
        ds_config = stages[stage]
        runs[f"zero{stage}"] = (
            tiny_run_config(tiny_data, tmp_path / f"z{stage}", max_steps=3, compile=True),
            ds_config,
        )
    recompute = tiny_run_config(
        tiny_data, tmp_path / "recompute", max_steps=3, compile=True, activation_checkpointing=True
    )
    runs["zero2+recompute"] = (recompute, stages[2])
    losses = run_distributed(losses_by_run, 1, args=(runs,), threads=2)[0]
    for name in runs:
        assert losses[name] == pytest.approx(losses["eager"], abs=1e-5), name


@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2, "grad_accum_steps": 2, "micro_batch_size": 2}],
    ids=["tensor2", "pipeline2"],
)
def test_compiled_blocks_train_to_the_eager_losses_in_model_parallel_layouts(tmp_path, tiny_data, layout):
    runs = {
        name: (tiny_run_config(tiny_data, tmp_path / name, max_steps=3, compile=name == "compiled", **layout), ZERO1)
        for name in ("eager", "compiled")
    }
    losses = run_distributed(losses_by_run, 2, args=(runs,))[0]
    assert losses["compiled graphs"] > 0
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=1e-5)


def test_auto_compiles_runs_long_enough_to_repay_compilation(tiny_data, tmp_path):
    from llmstack.training.compile import AUTO_MIN_STEPS
    from llmstack.training.config import run_layout

    def compiled(**train):
        return run_layout(parse_run_config(tiny_run_config(tiny_data, tmp_path, **train)), {}).compile

    assert parse_run_config(tiny_run_config(tiny_data, tmp_path)).train.compile == "auto"  # the default
    assert not compiled(max_steps=AUTO_MIN_STEPS - 1)
    assert compiled(max_steps=AUTO_MIN_STEPS)
    assert compiled(max_steps=3, compile=True) and not compiled(max_steps=AUTO_MIN_STEPS, compile=False)


@pytest.mark.parametrize("setting", ["sometimes", 1])
def test_an_unknown_compile_setting_is_refused(tiny_data, tmp_path, setting):
    from llmstack.errors import UserError

    with pytest.raises(UserError, match="train.compile must be true, false"):
        parse_run_config(tiny_run_config(tiny_data, tmp_path, compile=setting))


def test_a_backend_that_cannot_compile_falls_back_to_eager_with_one_warning(caplog):
    """The same numbers as eager, and one warning, when the compiler fails (here: a backend that
    raises, as inductor does without a working C++ compiler)."""
    import torch

    from llmstack import LLMStackConfig, LLMStackForCausalLM
    from llmstack.training.compile import compile_decoder_layers

    def broken_toolchain(graph, example_inputs):
        raise RuntimeError("no working C++ compiler")

    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    eager, compiled = LLMStackForCausalLM(config), LLMStackForCausalLM(config)
    compiled.load_state_dict(eager.state_dict())
    assert compile_decoder_layers(compiled, backend=broken_toolchain) == 2
    batch = torch.randint(0, 64, (2, 16))
    with caplog.at_level("WARNING", logger="llmstack.training.compile"):
        for model in (eager, compiled, compiled):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile failed (RuntimeError: no working C++ compiler); the decoder blocks run eager. "
        "Set train.compile: false to skip compilation."
    ]
    assert loss.item() == pytest.approx(eager(input_ids=batch, labels=batch).loss.item(), abs=1e-6)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(2 * a.grad, b.grad, atol=1e-6, rtol=1e-5)  # compiled stepped twice
