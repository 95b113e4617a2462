"""`llmstack sweep`: a 2x1 grid of 3-step trials (each an `llmstack train` subprocess, 2 at once),
its table, ranking, PNG and `--best`; a killed sweep resumed; the trials' determinism; bad
arguments refused before any trial starts."""

import json
import os
from contextlib import redirect_stdout

import matplotlib.image
import pytest
import yaml
from conftest import tiny_run_config

from llmstack.cli.main import main
from llmstack.errors import UserError
from llmstack.hparams.grid import grid_trials, parse_grid, parse_range, random_trials

GRID = ["--grid", "train.lr=1e-3,1e-2", "--grid", "train.micro_batch_size=4", "--steps", "3"]


@pytest.fixture(scope="module")
def config(tiny_data, tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep_config") / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run_config(tiny_data, "runs/unused")))
    return str(path)


@pytest.fixture(scope="module")
def swept(config, tmp_path_factory):
    """The sweep run once (2 trials in parallel): its directory and what it printed."""
    out = tmp_path_factory.mktemp("sweep") / "sweep"
    stdout = out.parent / "stdout.txt"
    with open(stdout, "w") as f, redirect_stdout(f):
        assert main(["sweep", "--config", config, *GRID, "--parallel", "2", "--out", str(out)]) == 0
    return out, stdout.read_text()


def table(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_each_trial_is_a_run_with_a_row_in_the_table(swept):
    out, _ = swept
    rows = table(out)
    assert [r["trial"] for r in rows] == ["t000", "t001"]
    assert [r["overrides"] for r in rows] == [
        {"train.lr": "1e-3", "train.micro_batch_size": "4"},
        {"train.lr": "1e-2", "train.micro_batch_size": "4"},
    ]
    for row in rows:
        assert row["status"] == "ok" and row["steps"] == 3 and row["val_loss"] > 0
        assert os.path.isfile(os.path.join(row["run_dir"], "metrics.jsonl"))
        assert os.path.isdir(os.path.join(row["run_dir"], "checkpoints"))


def test_ranking_by_validation_loss_on_stdout_and_png(swept):
    out, printed = swept
    rows = sorted(table(out), key=lambda r: r["val_loss"])
    lines = printed.strip().splitlines()
    assert lines[0].split() == [
        "rank",
        "trial",
        "val_loss",
        "train_loss",
        "status",
        "train.lr",
        "train.micro_batch_size",
    ]
    assert [line.split()[1] for line in lines[1:]] == [r["trial"] for r in rows]
    assert lines[1].split()[2] == f"{rows[0]['val_loss']:.4f}"
    height, width, _ = matplotlib.image.imread(out / "sweep.png").shape
    assert (width, height) == (1300, 500)  # curves and the 2-D grid's heat map


def test_a_killed_sweep_reruns_only_its_unfinished_trial_and_gets_the_same_numbers(swept, config, capsys):
    """Simulate a kill during t001: its row gone, its metrics cut off. The rerun restarts t001 from
    scratch, leaves t000 alone, and t001's losses come out as they did (seeded, bit for bit)."""
    out, _ = swept
    before = {r["trial"]: r for r in table(out)}
    (out / "results.jsonl").write_text(json.dumps(before["t000"]) + "\n" + '{"trial": "t0')  # cut mid-line
    metrics = out / "trials" / "t001" / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:100])
    t000_log = (out / "logs" / "t000.log").stat().st_mtime_ns
    assert main(["sweep", "--config", config, *GRID, "--out", str(out)]) == 0
    after = {r["trial"]: r for r in table(out)}
    assert after["t000"] == before["t000"] and (out / "logs" / "t000.log").stat().st_mtime_ns == t000_log
    assert after["t001"]["val_loss"] == before["t001"]["val_loss"]
    assert after["t001"]["train_loss"] == before["t001"]["train_loss"]
    capsys.readouterr()
    # Everything done: --best prints the winner's overrides only, without running anything.
    assert main(["sweep", "--config", config, *GRID, "--out", str(out), "--best"]) == 0
    best = min(after.values(), key=lambda r: r["val_loss"])
    assert capsys.readouterr().out == " ".join(f"{k}={v}" for k, v in best["overrides"].items()) + "\n"


def test_another_sweep_into_the_same_directory_is_refused(swept, config, capsys):
    out, _ = swept
    assert main(["sweep", "--config", config, "--grid", "train.lr=1e-4,1e-3", "--steps", "3", "--out", str(out)]) == 2
    assert "holds another sweep (sweep.json differs in: trials)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grid", "train.lr"], "--grid 'train.lr' must look like section.key=v1,v2,..."),
        (["--grid", "lr=1,2"], "must look like section.key=v1,v2"),
        (["--grid", "train.lr=1e-3,,2e-3"], "has an empty value"),
        (["--grid", "train.lrr=1e-3,2e-3"], "unknown key(s) train.lrr"),
        (["--grid", "train.micro_batch_size=4,eight"], "train.micro_batch_size must be a int"),
        (["--grid", "train.max_steps=1,2"], "train.max_steps is set by the sweep"),
        (["--range", "train.lr=1e-4:1e-2:log"], "--range needs --samples"),
        (["--range", "train.lr=1e-2:1e-4", "--samples", "2"], "LOW must be below HIGH"),
        (["--range", "train.lr=a:b", "--samples", "2"], "LOW and HIGH must be numbers"),
        ([], "give at least one --grid"),
    ],
)
def test_bad_arguments_are_refused_before_any_trial(config, tmp_path, capsys, args, message):
    assert main(["sweep", "--config", config, "--steps", "2", "--out", str(tmp_path / "s"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s" / "trials").exists()


def test_missing_config_is_a_user_error(tmp_path, capsys):
    assert main(["sweep", "--config", str(tmp_path / "nope.yaml"), "--grid", "train.lr=1,2", "--steps", "1"]) == 2
    assert "nope.yaml not found" in capsys.readouterr().err


def test_random_search_is_seeded_and_stays_in_its_ranges():
    ranges = [parse_range("train.lr=1e-4:1e-2:log"), parse_range("train.micro_batch_size=2:16")]
    choices = [parse_grid("train.warmup_steps=0,10")]
    trials = random_trials(choices, ranges, samples=20, seed=3)
    assert trials == random_trials(choices, ranges, samples=20, seed=3) != random_trials(choices, ranges, 20, seed=4)
    assert all(1e-4 <= float(t["train.lr"]) <= 1e-2 for t in trials)
    assert all(t["train.micro_batch_size"].isdigit() and 2 <= int(t["train.micro_batch_size"]) <= 16 for t in trials)
    assert {t["train.warmup_steps"] for t in trials} == {"0", "10"}
    # log-uniform: about half the draws below the geometric middle 1e-3
    lows = sum(float(t["train.lr"]) < 1e-3 for t in random_trials([], ranges[:1], 400, seed=0))
    assert 160 < lows < 240


def test_grid_is_the_product_first_key_slowest():
    trials = grid_trials([parse_grid("train.lr=1,2"), parse_grid("train.micro_batch_size=4,8")])
    assert [tuple(t.values()) for t in trials] == [("1", "4"), ("1", "8"), ("2", "4"), ("2", "8")]
    with pytest.raises(UserError, match="swept twice"):
        grid_trials([parse_grid("train.lr=1,2"), parse_grid("train.lr=3,4")])


def test_parallel_trials_share_the_threads_and_get_a_gpu_each(monkeypatch):
    from llmstack.hparams.sweep import trial_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = trial_environment(parallel=2, slot=1, gpus=["0", "1", "2"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert "CUDA_VISIBLE_DEVICES" not in trial_environment(parallel=2, slot=1, gpus=[])
