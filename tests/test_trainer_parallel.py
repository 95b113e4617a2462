"""The trainer with tensor and with pipeline parallelism (2 ranks each, data-parallel size 1):
both read the same samples, so their losses equal each other's step for step, and fall."""

import json

from conftest import tiny_run_config

from llmstack.testing import run_distributed


def train_layouts(rank, world_size, raw_by_name):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    losses = {}
    for name, raw in raw_by_name.items():
        Trainer(parse_run_config(raw), ds_config_path="ds_configs/zero1.json").train()
        with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        losses[name] = (
            [r["loss"] for r in records if "loss" in r],
            [r["val_loss"] for r in records if "val_loss" in r],
        )
    return losses


def test_tensor_and_pipeline_parallel_training_agree(tmp_path, tiny_data):
    layouts = {
        "tensor2": {"tensor_parallel_size": 2},
        "pipeline2": {"pipeline_parallel_size": 2, "grad_accum_steps": 2, "micro_batch_size": 2},
    }
    raw_by_name = {
        name: tiny_run_config(tiny_data, tmp_path / name, eval_interval=6, **layout) for name, layout in layouts.items()
    }
    for raw in raw_by_name.values():
        raw["train"].setdefault("micro_batch_size", 4)
    results = run_distributed(train_layouts, 2, args=(raw_by_name,))
    (tp_loss, tp_val), (pp_loss, pp_val) = results[0]["tensor2"], results[0]["pipeline2"]
    assert len(tp_loss) == len(pp_loss) == 6
    assert tp_loss[-1] < tp_loss[0] - 0.3
    for a, b in zip(tp_loss + tp_val, pp_loss + pp_val):
        assert abs(a - b) < 1e-4, (tp_loss, pp_loss, tp_val, pp_val)
