"""train.compile: compiled decoder blocks train to the eager losses (1e-5) without ZeRO, under
ZeRO-3's parameter hooks and with activation checkpointing (ZeRO-1/2 partition only the optimizer,
which compile does not see; each compiled run costs tens of seconds, so they are left out); layouts
it does not cover are refused before start-up."""

import json

import pytest
from conftest import tiny_run_config

from llmstack.errors import UserError
from llmstack.testing import run_distributed
from llmstack.training.compile import check_compile_supported
from llmstack.training.config import parse_run_config

ZERO0 = {"zero_optimization": {"stage": 0}}


def losses_by_run(rank, world_size, runs):
    from llmstack.training import Trainer

    losses = {}
    for name, (raw, ds_config) in runs.items():
        Trainer(parse_run_config(raw), ds_config_path=ds_config).train()
        with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
            losses[name] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
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


def test_compile_with_tensor_or_pipeline_parallelism_is_refused(tmp_path, tiny_data):
    run = parse_run_config(tiny_run_config(tiny_data, tmp_path, compile=True, tensor_parallel_size=2))
    with pytest.raises(UserError, match="train.compile works with data parallelism"):
        check_compile_supported(run.train)
