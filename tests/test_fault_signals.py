"""Signals and exits as a cluster delivers them, under the real deepspeed launcher and its CPU
all-reduce: a SIGTERM to the whole process group (each rank gets it twice: the group's and the
launcher's forward) always ends with the save written; a third request stops at once; a rank that
loses its peer says so in one line; nothing of a job stays in /dev/shm."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import tiny_run_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llmstack.compat.deepspeed import ALLREDUCE_BUFFER_PREFIX, SHM_DIR, remove_stale_allreduce_buffers
from llmstack.monitor.plot import panels_of, read_metrics
from llmstack.net import free_port
from llmstack.training.checkpoint.files import read_latest

# Hang guards only, far above what a run takes on a loaded machine: nothing here times anything.
HANG_GUARD_S = 600
SIGNAL_RANK = Path(__file__).parent / "signal_rank.py"
STRAGGLER_RANK = Path(__file__).parent / "straggler_rank.py"


def launch(args: list[str], log_path: Path, port: int) -> subprocess.Popen:
    """`deepspeed --num_gpus 2 ARGS` in its own process group, as a scheduler starts a job."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port)]
    with open(log_path, "w") as log:
        return subprocess.Popen([*command, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def with_kill(job: subprocess.Popen) -> None:
    """Leave nothing of the job running when a test fails half-way."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)


def wait_until(condition, what: str, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert job.poll() is None or job.returncode == 0, f"the job ended (code {job.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {HANG_GUARD_S}s"
        time.sleep(0.05)


def job_processes(job: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(job.pid)
    return [root, *root.children(recursive=True)]


def wait_for_exit(processes: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(processes, timeout=HANG_GUARD_S)
    assert not alive, f"still running after {HANG_GUARD_S}s: {alive}"


def buffers_of(port: int) -> list[str]:
    return [p.name for p in SHM_DIR.iterdir() if p.name.startswith(ALLREDUCE_BUFFER_PREFIX) and f"_{port}_" in p.name]


# Before the fix, 6 of 10 group SIGTERMs lost the save of at least one rank; 6 tries of a correct
# fix all save, while the old handler passes all 6 with probability 0.4**6 = 0.4%.
GROUP_SIGTERMS = 6


def test_a_sigterm_to_the_whole_job_always_saves_and_leaves_no_shared_memory(tmp_path):
    for attempt in range(GROUP_SIGTERMS):
        out, port = tmp_path / f"try{attempt}", free_port()
        out.mkdir()
        job = launch([str(SIGNAL_RANK), str(out), "1.0"], tmp_path / f"try{attempt}.log", port)
        try:
            wait_until(lambda out=out: (out / "ready0").exists() and (out / "ready1").exists(), "both ranks ready", job)
            # The CPU all-reduce ran (2 ranks summed ones) and its /dev/shm names are already gone.
            assert (out / "ready0").read_text().split()[1] == "2"
            assert buffers_of(port) == []
            processes = job_processes(job)
            os.killpg(job.pid, signal.SIGTERM)
            if attempt % 2:  # the scheduler signals again
                time.sleep(0.005)
                os.killpg(job.pid, signal.SIGTERM)
            wait_for_exit(processes)
        finally:
            with_kill(job)
        log = (tmp_path / f"try{attempt}.log").read_text()
        for rank in (0, 1):
            assert (out / f"saved{rank}").exists(), f"try {attempt}: rank {rank} did not save\n{log}"
            assert (out / f"exit{rank}").read_text() == str(128 + signal.SIGTERM)
        assert "Traceback" not in log, log
        assert buffers_of(port) == []


def test_a_rank_that_loses_its_peer_says_so_in_one_line(tmp_path):
    port = free_port()
    job = launch([str(SIGNAL_RANK), str(tmp_path), "1.0"], tmp_path / "job.log", port)
    try:
        wait_until(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), "both ranks ready", job)
        processes = job_processes(job)
        pid1 = int((tmp_path / "ready1").read_text().split()[0])
        os.kill(pid1, signal.SIGKILL)
        wait_for_exit(processes)
    finally:
        with_kill(job)
    log = (tmp_path / "job.log").read_text()
    assert "Traceback" not in log, log
    assert "rank 0 lost its connection to another rank" in log, log
    assert buffers_of(port) == []


def test_sigterm_twice_5ms_apart_to_llmstack_train_writes_the_async_save(tmp_path, tiny_data):
    out, port = tmp_path / "run", free_port()
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(tiny_run_config(tiny_data, out, max_steps=100000, save_interval=100000, async_save=True))
    )
    args = ["--module", "llmstack", "train", "--config", str(config), "--ds-config", "ds_configs/zero2.json"]
    job = launch(args, tmp_path / "train.log", port)
    metrics = out / "metrics.jsonl"
    try:
        wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, "three logged steps", job)
        processes = job_processes(job)
        os.killpg(job.pid, signal.SIGTERM)
        time.sleep(0.005)
        os.killpg(job.pid, signal.SIGTERM)
        wait_for_exit(processes)
    finally:
        with_kill(job)
    log = (tmp_path / "train.log").read_text()
    tag = read_latest(str(out / "checkpoints"))
    assert tag is not None and int(tag.removeprefix("global_step")) >= 3, log
    assert "Traceback" not in log, log
    assert buffers_of(port) == []


THREE_REQUESTS = """
import os, signal, time
from types import SimpleNamespace
from llmstack.training.faults import FaultGuard
cfg = SimpleNamespace(max_nonfinite_steps=1, loss_spike_factor=0.0, loss_spike_window=1, sigterm_grace_s=600)
with FaultGuard(cfg, fp16=False, device="cpu") as guard:
    print("ready", flush=True)
    time.sleep(600)  # a save that never finishes
"""


def test_the_third_signal_stops_at_once_and_copies_do_not_count(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", THREE_REQUESTS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "ready\n"
    for _ in range(2):  # two requests, each with a copy 5 ms later: the save goes on
        process.send_signal(signal.SIGTERM)
        time.sleep(0.005)
        process.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert process.poll() is None
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "SIGTERM again: the checkpoint is still being saved" in stderr
    assert "SIGINT, request 3: stopping at once, without saving" in stderr


def test_a_new_job_removes_stale_buffers_but_never_a_live_jobs(tmp_path):
    stale = SHM_DIR / f"{ALLREDUCE_BUFFER_PREFIX}_{os.getuid()}_127.0.0.1_0_0"
    live = SHM_DIR / f"{ALLREDUCE_BUFFER_PREFIX}_{os.getuid()}_127.0.0.1_0_1"
    stale.write_bytes(b"\0" * 64)
    with open(live, "wb") as held:  # this process is the live job that holds it
        try:
            assert stale.name in remove_stale_allreduce_buffers()
            assert not stale.exists() and live.exists()
        finally:
            held.close()
            live.unlink()
            stale.unlink(missing_ok=True)


@pytest.mark.parametrize("stopped", [1, 0])
def test_a_hung_rank_ends_the_job_within_the_collective_timeout_naming_it(tmp_path, stopped):
    """SIGSTOP stands for a rank that hangs: its peer leaves the collective after
    collective_timeout_s, names the rank that did not arrive and exits non-zero. Rank 0 hosts the
    rendezvous store, so when it is the one stopped, the store's silence names it."""
    port = free_port()
    job = launch([str(SIGNAL_RANK), str(tmp_path), "1.0", "2.0"], tmp_path / "job.log", port)
    survivor = 1 - stopped
    try:
        wait_until(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), "both ranks ready", job)
        processes = job_processes(job)
        pids = {rank: int((tmp_path / f"ready{rank}").read_text().split()[0]) for rank in (0, 1)}
        os.kill(pids[stopped], signal.SIGSTOP)
        # The launcher would SIGKILL the stopped rank 30 s after the survivor exits; do it sooner.
        wait_for_exit([p for p in processes if p.pid == pids[survivor]])
        os.kill(pids[stopped], signal.SIGKILL)
        wait_for_exit(processes)
    finally:
        with_kill(job)
    log = (tmp_path / "job.log").read_text()
    assert job.returncode != 0
    assert "Traceback" not in log, log
    assert f"rank {survivor} waited 2 s (train.collective_timeout_s) in a collective for another rank" in log, log
    assert f"rank {stopped} did not arrive" in log, log


def test_a_rank_that_reads_its_data_slowly_is_named_a_straggler_in_every_sink(tmp_path, tiny_data):
    out = tmp_path / "run"
    config = tiny_run_config(tiny_data, out, max_steps=6, log_interval=2, straggler_patience=2, compile=False)
    config["data"]["prefetch"] = 0  # read on demand: no reader thread hides the delay
    config["monitor"] = {"console": True, "tensorboard": True}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    # Rank 1 waits 1.5 s per micro-batch for its data. Each rank's forward pass takes 0.05-0.5 s
    # here (two ranks on two loaded cores), so rank 1's own time is at least 3x rank 0's.
    args = [str(STRAGGLER_RANK), str(tmp_path / "run.yaml"), "ds_configs/zero2.json", "1", "1.5"]
    job = launch(args, tmp_path / "job.log", free_port())
    try:
        job.wait(timeout=HANG_GUARD_S)
    finally:
        with_kill(job)
    log = (tmp_path / "job.log").read_text()
    assert job.returncode == 0, log
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "straggler/ratio" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for record in logged:
        assert record["straggler/ratio"] >= 2.0 and record["straggler/data_wait_s"] >= 1.5, record
    # named from the second slow interval on (straggler_patience)
    assert [r["straggler/rank"] for r in logged] == [-1, 1, 1]
    assert "rank 1 is a straggler" in log and "rank 0 is a straggler" not in log, log
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [s.value for s in events.Scalars("straggler/rank")] == [-1, 1, 1]
    assert "Stragglers" in [title for title, *_ in panels_of(read_metrics(out))]
