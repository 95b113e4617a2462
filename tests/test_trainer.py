"""The trainer: config errors a user can make, every ZeRO ds_config training on 2 ranks,
activation checkpointing giving the same losses, and training from a streaming mixture."""

import json
import subprocess
import sys

import pytest
import yaml
from conftest import tiny_run_config

from llmstack.errors import UserError
from llmstack.testing import run_distributed
from llmstack.training.config import load_run_config, parse_run_config
from llmstack.training.cpu_bf16 import cpu_bf16_report
from llmstack.training.ds_config import complete_ds_config, load_ds_config

DS_CONFIGS = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_unknown_key_names_the_key_and_the_valid_ones(tmp_path, tiny_data):
    raw = tiny_run_config(tiny_data, tmp_path)
    raw["train"]["learning_rate"] = 1e-3
    with pytest.raises(UserError, match=r"unknown key\(s\) train.learning_rate; valid keys are: .*\blr\b"):
        parse_run_config(raw)
    raw = tiny_run_config(tiny_data, tmp_path)
    raw["model"]["hiden_size"] = 8
    with pytest.raises(UserError, match="model.hiden_size.*hidden_size"):
        parse_run_config(raw)


def test_overrides_are_parsed_as_yaml_values(tmp_path, tiny_data):
    path = write_yaml(tmp_path / "run.yaml", tiny_run_config(tiny_data, tmp_path))
    run = load_run_config(path, ["train.lr=1e-4", "train.max_steps=3", "data.train=[a, b]"])
    assert run.train.lr == 1e-4 and run.train.max_steps == 3 and run.data.train == ["a", "b"]
    with pytest.raises(UserError, match="section.key=value"):
        load_run_config(path, ["lr=3"])
    with pytest.raises(UserError, match="train.max_steps must be a int"):
        load_run_config(path, ["train.max_steps=many"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--resume", "auto", "train.lr=1e-4", "train.max_steps=3"],
        ["train.lr=1e-4", "--resume", "auto", "train.max_steps=3"],
        ["train.lr=1e-4", "train.max_steps=3", "--resume", "auto"],
    ],
)
def test_every_override_is_taken_wherever_it_stands_among_the_options(argv):
    from llmstack.cli.main import build_parser, parse_args

    parser = build_parser(load="train")
    args = parse_args(parser, ["train", "--config", "run.yaml", *argv])
    assert args.resume == "auto" and args.overrides == ["train.lr=1e-4", "train.max_steps=3"]
    with pytest.raises(SystemExit):  # anything else unknown is argparse's error, as before
        parse_args(parser, ["train", "--config", "run.yaml", "train.lr=1", "--resume", "auto", "--bogus"])


def test_batch_size_mismatch_names_the_three_numbers(tmp_path, tiny_data):
    run = parse_run_config(tiny_run_config(tiny_data, tmp_path, micro_batch_size=4, grad_accum_steps=2))
    with pytest.raises(
        UserError, match=r"train_batch_size=64.*micro_batch_size 4 x grad_accum_steps 2 x data_parallel_size 2"
    ):
        complete_ds_config({"train_batch_size": 64}, run.train, dp_size=2)
    run.train.global_batch_size = 10
    with pytest.raises(
        UserError, match=r"train_batch_size 10 != micro_batch_size 4 x grad_accum_steps 2 x data_parallel_size 2"
    ):
        complete_ds_config({}, run.train, dp_size=2)
    run.train.global_batch_size = 16
    filled = complete_ds_config(load_ds_config("ds_configs/zero2.json"), run.train, dp_size=2)
    assert filled["train_batch_size"] == 16 and filled["optimizer"]["params"]["lr"] == run.train.lr


def test_user_errors_print_one_line_without_traceback(tmp_path, tiny_data):
    raw = tiny_run_config(tiny_data, tmp_path)
    used = tiny_run_config(tiny_data, tmp_path / "used")  # started without --resume where a run saved
    (tmp_path / "used" / "checkpoints").mkdir(parents=True)
    (tmp_path / "used" / "checkpoints" / "latest").write_text("global_step5")
    raw["data"]["tokenizer"] = str(tmp_path / "missing_tokenizer")
    cases = [
        (["--config", str(tmp_path / "nope.yaml")], "nope.yaml not found"),
        (["--config", write_yaml(tmp_path / "bad.yaml", {**raw, "optimiser": {}})], "unknown key(s) optimiser"),
        (
            ["--config", write_yaml(tmp_path / "run.yaml", raw), "--ds-config", "ds_configs/none.json"],
            "none.json not found",
        ),
        (["--config", write_yaml(tmp_path / "run2.yaml", raw)], "missing_tokenizer not found"),
        (
            ["--config", write_yaml(tmp_path / "used.yaml", used)],
            "holds an earlier run's checkpoints (latest: global_step5)",
        ),
    ]
    for args, message in cases:
        result = subprocess.run([sys.executable, "-m", "llmstack", "train", *args], capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


def write_jsonl_files(directory, words, files=2, docs=40):
    """A mixture source: `files` JSONL files (a multiple of the 2 ranks) of repeated phrases."""
    directory.mkdir()
    for i in range(files):
        with open(directory / f"part{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": f"{words} {n}. " * 5}) + "\n" for n in range(docs))
    return str(directory / "*.jsonl")


def train_every_ds_config(rank, world_size, raw_by_name):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    losses, shares = {}, {}
    for name, raw in raw_by_name.items():
        trainer = Trainer(parse_run_config(raw), ds_config_path=f"ds_configs/{name.split('+')[0]}.json")
        trainer.train()
        if rank == 0:
            with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
                records = [r for r in map(json.loads, f) if "loss" in r]
            losses[name] = [r["loss"] for r in records]
            shares[name] = {k: v for k, v in records[-1].items() if k.startswith("data_share/")}
    return losses, shares


def test_every_zero_ds_config_trains_two_ranks(tmp_path, tiny_data):
    raw_by_name = {name: tiny_run_config(tiny_data, tmp_path / name) for name in DS_CONFIGS}
    raw_by_name["zero2+recompute"] = tiny_run_config(tiny_data, tmp_path / "recompute", activation_checkpointing=True)
    stream = tiny_run_config(tiny_data, tmp_path / "stream")
    stream["data"]["train"] = []
    stream["data"]["sources"] = [
        {"name": name, "paths": write_jsonl_files(tmp_path / name, words), "weight": weight}
        for name, words, weight in (
            ("prose", "a lazy dog sleeps in the sun", 0.7),
            ("code", "def f ( x ) : return x", 0.3),
        )
    ]
    raw_by_name["zero2+stream"] = stream
    mixed = tiny_run_config(tiny_data, tmp_path / "packed_mixture")  # the same shards as two weighted sources
    mixed["data"]["train"] = [{"name": n, "prefixes": tiny_data["train"], "weight": w} for n, w in (("a", 1), ("b", 3))]
    raw_by_name["zero2+packed_mixture"] = mixed
    # The trainer wires precision and llmstack's optimizers. bf16 runs where the CPU has it natively
    # (AMX / AVX-512 bf16); emulated (AVX2 only) it takes minutes even for this model.
    extra = ("bf16_zero2", "onebit_adam") if cpu_bf16_report().native else ("onebit_adam",)
    for name in extra:
        raw_by_name[name] = tiny_run_config(tiny_data, tmp_path / name)
    losses, shares = run_distributed(train_every_ds_config, 2, args=(raw_by_name,))[0]
    # A mixture logs each named source's share of the tokens trained; plain packed shards log none.
    assert shares["zero2"] == {}
    stream_shares = shares["zero2+stream"]
    assert set(stream_shares) == {"data_share/prose", "data_share/code"}
    assert stream_shares["data_share/prose"] == pytest.approx(0.7, rel=0.2)  # 6 steps x 2 ranks x 4 x 32 tokens
    assert shares["zero2+packed_mixture"] == pytest.approx({"data_share/a": 0.25, "data_share/b": 0.75}, abs=1 / 48)
    # Activation checkpointing recomputes the same forward: the same losses.
    assert losses["zero2+recompute"] == pytest.approx(losses["zero2"], abs=1e-6)
    for name in [*DS_CONFIGS, "zero2+stream", "zero2+packed_mixture", *extra]:
        assert len(losses[name]) == 6, name
        assert losses[name][-1] < losses[name][0] - 0.3, (name, losses[name])
    # Same seed, same data, fp32: every ZeRO stage computes the same first loss.
    firsts = [losses[n][0] for n in DS_CONFIGS]
    assert max(firsts) - min(firsts) < 1e-5
