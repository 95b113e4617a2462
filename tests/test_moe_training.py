"""An MoE model trains under the trainer (2 ranks, ZeRO-2): the loss falls, the routing metrics
reach the metrics sinks, and `llmstack plot` draws expert load."""

import json

import matplotlib.image
import pytest
from conftest import tiny_run_config

from llmstack.cli.main import main
from llmstack.testing import run_distributed

MOE = {"num_local_experts": 4, "num_experts_per_tok": 2, "router_z_loss_coef": 0.001}


def train_moe(rank, world_size, raw):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    Trainer(parse_run_config(raw), ds_config_path="ds_configs/zero2.json").train()


def test_moe_model_trains_with_zero2_and_logs_expert_load(tmp_path, tiny_data):
    raw = tiny_run_config(tiny_data, tmp_path / "moe")
    raw["model"].update(MOE)
    run_distributed(train_moe, 2, args=(raw,))
    with open(tmp_path / "moe" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    assert len(records) == 6
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    for record in records:
        for layer in (0, 1):
            load = [record[f"moe/load/layer{layer}/expert{e}"] for e in range(4)]
            assert sum(load) == pytest.approx(1.0)
            assert record[f"moe/imbalance/layer{layer}"] == pytest.approx(4 * max(load))
        # dropless routing; balanced top-2 routing would give an aux loss of 2
        assert record["moe/dropped_tokens"] == 0 and 1.9 < record["moe/aux_loss"] < 4
        assert record["moe/z_loss"] > 0
    assert main(["plot", str(tmp_path / "moe")]) == 0
    height, width, _ = matplotlib.image.imread(tmp_path / "moe" / "metrics.png").shape
    # the 5 fixed panels (accuracy beside the loss), expert load imbalance, one per MoE layer: 5 rows
    assert (width, height) == (1200, 2000)
