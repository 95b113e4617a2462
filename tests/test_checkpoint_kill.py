"""A real multi-rank run loses a rank to SIGKILL; rerunning the same command with `--resume auto`
continues the loss curve exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import yaml
from conftest import tiny_run_config

from llmstack.net import free_port


def records(metrics_path):
    if not os.path.isfile(metrics_path):
        return []
    with open(metrics_path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def rank_process(launcher, local_rank):
    """The training process of `local_rank` under a running `deepspeed` launcher."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "llmstack" in cmdline and f"--local_rank={local_rank}" in cmdline:
            return child
    return None


# Hang guards only, far above what a run takes even on a loaded machine: nothing here times the run.
HANG_GUARD_S = 1800


def wait_for(condition, launcher, what):
    """Poll `condition` until it holds; fails if the launcher exits first (or the run hangs)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert launcher.poll() is None, f"the run ended (exit code {launcher.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {HANG_GUARD_S}s: the run hangs"
        time.sleep(0.05)


def test_sigkill_of_a_rank_then_resume_auto_continues_the_loss_curve(tmp_path, tiny_data):
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tiny_data, out, max_steps=30, save_interval=5, keep_last=2)))
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "llmstack",
        "train",
        "--config",
        str(config),
        "--ds-config",
        "ds_configs/zero2.json",
        "--resume",
        "auto",
    ]
    metrics = out / "metrics.jsonl"
    with open(tmp_path / "killed.log", "w") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            # Kill rank 1 once step 5 is saved and the run has gone on past it.
            wait_for(
                lambda: (
                    (out / "checkpoints" / "global_step5").is_dir()
                    and any(r.get("step", 0) >= 7 for r in records(metrics))
                ),
                launcher,
                "step 7",
            )
            os.kill(rank_process(launcher, 1).pid, signal.SIGKILL)
            assert launcher.wait(timeout=HANG_GUARD_S) != 0
        finally:
            if launcher.poll() is None:
                launcher.kill()
    killed = {r["step"]: r["loss"] for r in records(metrics) if "loss" in r}
    assert max(killed) < 30

    resumed_run = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert resumed_run.returncode == 0, resumed_run.stdout[-3000:] + resumed_run.stderr[-3000:]
    losses = [r for r in records(metrics) if "loss" in r]
    resumed = {r["step"]: r["loss"] for r in losses[len(killed) :]}
    start = min(resumed) - 1  # the checkpoint it resumed from: the newest the killed run finished
    assert start >= 5 and start % 5 == 0 and max(resumed) == 30
    overlap = [step for step in killed if step > start]
    assert overlap, "the killed run logged no step after its last checkpoint"
    assert {s: resumed[s] for s in overlap} == {s: killed[s] for s in overlap}
