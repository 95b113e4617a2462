"""The one layout table: every refusal names its kind, reason and way out; a layout breaking
several rules hears of all of them at once, before any process group exists; `llmstack doctor
--layouts` prints the table that docs/parallelism.md shows."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import tiny_run_config

from llmstack.errors import UserError
from llmstack.parallel.layout import RULES, TWO_RANK_LAYOUTS, Layout, check_layout, format_table, refusals
from llmstack.training.config import parse_run_config, run_layout

DOCS = Path(__file__).resolve().parents[1] / "docs" / "parallelism.md"


def test_every_rule_says_why_and_what_to_do():
    assert len({rule.name for rule in RULES}) == len(RULES)
    for rule in RULES:
        assert rule.kind in ("upstream", "physical", "not implemented"), rule.name
        assert rule.reason and rule.way_out, rule.name


def test_the_plain_layouts_of_the_table_are_supported():
    for name, layout in TWO_RANK_LAYOUTS.items():
        if layout.expert == 1:
            assert not refusals(layout), name


def test_a_layout_breaking_two_rules_is_told_both():
    layout = Layout(pipeline=2, zero_stage=3, sequence_parallel=True)
    with pytest.raises(UserError) as refused:
        check_layout(layout)
    message = str(refused.value)
    assert "for 3 reasons" in message
    for name in ("pipeline parallelism with ZeRO stage 2 or 3", "sequence parallelism without tensor parallelism"):
        assert name in message
    assert "ds_configs/zero1.json" in message  # the way out


def test_run_layout_reads_the_run_config_and_the_ds_config(tmp_path):
    raw = tiny_run_config({"tokenizer": "tok", "train": ["data"]}, tmp_path, tensor_parallel_size=2)
    raw["train"]["pipeline_parallel_size"] = 2
    raw["train"].update(sequence_parallel=True, compile=True)
    raw["model"].update(num_local_experts=4, num_experts_per_tok=2)
    layout = run_layout(parse_run_config(raw), {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}})
    assert (layout.tensor, layout.pipeline, layout.zero_stage, layout.precision) == (2, 2, 1, "bf16")
    assert layout.model == "moe" and layout.sequence_parallel and layout.compile
    assert [rule.name for rule in refusals(layout)] == ["sequence parallelism with pipeline parallelism"]


def test_the_trainer_refuses_a_layout_before_starting_anything(tmp_path, tiny_data):
    run = parse_run_config(tiny_run_config(tiny_data, tmp_path, pipeline_parallel_size=2))
    from llmstack.training import Trainer

    with pytest.raises(UserError, match="pipeline parallelism with ZeRO stage 2 or 3"):
        Trainer(run, ds_config_path="ds_configs/zero2.json")
    assert not dist.is_initialized()


def test_doctor_prints_the_table_the_docs_show():
    result = subprocess.run(
        [sys.executable, "-m", "llmstack", "doctor", "--layouts"], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == format_table()
    assert "real_accelerator" not in result.stderr  # reading the table loads no DeepSpeed
    shown = re.search(r"<!-- layout-table -->\n(.*)\n<!-- /layout-table -->", DOCS.read_text(), re.S)
    assert shown is not None and shown.group(1) == format_table(markdown=True)


def test_expert_parallelism_takes_zero3_without_tensor_parallelism():
    assert not refusals(Layout(expert=2, zero_stage=3, model="moe"))
    with_tensor = Layout(expert=2, tensor=2, zero_stage=3, model="moe")
    assert [rule.name for rule in refusals(with_tensor)] == ["expert and tensor parallelism with ZeRO stage 3"]
