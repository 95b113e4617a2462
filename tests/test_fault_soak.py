"""The soak: one 2-rank run taken down by nine seeded faults of the kinds a cluster delivers (rank
and group kills, kills during a synchronous and an asynchronous save, SIGTERMs to a rank, the
launcher and the whole group, a hung rank, a full disk), restarted after each with the same
`llmstack train ... --resume auto`, ends exactly where an uninterrupted run ends: the same weights
bit for bit, every logged loss equal to the uninterrupted run's at its step, the same number of
samples consumed."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import yaml
from conftest import tiny_run_config

from llmstack.net import free_port
from llmstack.training.checkpoint.files import read_latest

SEED = 0
STEPS = 45
SAVE_EVERY = 3
# Hang guard only, far above what a launch takes on a loaded machine: nothing here times anything.
HANG_GUARD_S = 600
# Long enough for any legitimate gap between the two ranks here (start-up, a save on a loaded machine).
HUNG_TIMEOUT_S = 10


class Launch:
    """One `llmstack train --resume auto` job under the deepspeed launcher, in its own process group."""

    def __init__(self, config: Path, out: Path, log: Path, *overrides: str) -> None:
        self.out, self.log = out, log
        self.first_record = len(records(out))
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
        command += ["--master_port", str(free_port()), "--module", "llmstack", "train", "--config", str(config)]
        command += ["--ds-config", "ds_configs/zero2.json", "--resume", "auto", *overrides]
        with open(log, "w") as f:
            self.job = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def logged_step(self) -> int:
        steps = [r["step"] for r in records(self.out)[self.first_record :] if "loss" in r]
        return max(steps, default=0)

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not condition():
            assert self.job.poll() is None, f"the job ended (code {self.job.returncode}) before {what}\n{self.text()}"
            assert time.monotonic() < deadline, f"no {what} after {HANG_GUARD_S}s"
            time.sleep(0.002)

    def rank_pid(self, rank: int) -> int:
        self.wait_until(lambda: self._rank_pid(rank) is not None, f"rank {rank}")
        return self._rank_pid(rank)

    def _rank_pid(self, rank: int) -> int | None:
        for child in psutil.Process(self.job.pid).children(recursive=True):
            try:
                if f"--local_rank={rank}" in child.cmdline() and "llmstack" in child.cmdline():
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        return None

    def end(self) -> int:
        """Wait for every process of the job; return the launcher's exit code."""
        processes = [psutil.Process(self.job.pid), *psutil.Process(self.job.pid).children(recursive=True)]
        code = self.job.wait(timeout=HANG_GUARD_S)
        _, alive = psutil.wait_procs(processes, timeout=HANG_GUARD_S)
        assert not alive, f"still running: {alive}"
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def text(self) -> str:
        return self.log.read_text()


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def saving(out: Path) -> bool:
    return any(p.name.startswith(".tmp-global_step") for p in (out / "checkpoints").iterdir())


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    path = out / "checkpoints" / f"global_step{STEPS}" / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def consumed_samples(out: Path) -> int:
    state = json.loads((out / "checkpoints" / f"global_step{STEPS}" / "llmstack_state.json").read_text())
    return state["consumed_samples"]


# What each fault does to a running launch, given the step it fires at (or after): one or two steps
# past the launch's first new checkpoint, so that every launch moves the run on (45 steps hold
# eight faults of at most five steps each).
def signal_rank(rank: int, signum: int) -> Callable[[Launch, int], None]:
    def fault(launch: Launch, step: int) -> None:
        pid = launch.rank_pid(rank)
        launch.wait_until(lambda: launch.logged_step() >= step, f"step {step}")
        os.kill(pid, signum)

    return fault


def kill_rank_during_save(rank: int) -> Callable[[Launch, int], None]:
    def fault(launch: Launch, step: int) -> None:
        pid = launch.rank_pid(rank)
        launch.wait_until(lambda: launch.logged_step() >= step and saving(launch.out), f"a save after step {step}")
        os.kill(pid, signal.SIGKILL)

    return fault


def kill_group(launch: Launch, step: int) -> None:
    launch.wait_until(lambda: launch.logged_step() >= step, f"step {step}")
    os.killpg(launch.job.pid, signal.SIGKILL)


def sigterm_group_twice(launch: Launch, step: int) -> None:
    launch.wait_until(lambda: launch.logged_step() >= step, f"step {step}")
    os.killpg(launch.job.pid, signal.SIGTERM)
    time.sleep(0.005)
    os.killpg(launch.job.pid, signal.SIGTERM)


def hang_rank(rank: int) -> Callable[[Launch, int], None]:
    """SIGSTOP: the other rank leaves after the collective timeout; then the stopped one is killed
    (as the launcher does 30 s after a rank fails)."""

    def fault(launch: Launch, step: int) -> None:
        pids = {r: launch.rank_pid(r) for r in (0, 1)}
        launch.wait_until(lambda: launch.logged_step() >= step, f"step {step}")
        os.kill(pids[rank], signal.SIGSTOP)
        psutil.wait_procs([psutil.Process(pids[1 - rank])], timeout=HANG_GUARD_S)
        os.kill(pids[rank], signal.SIGKILL)

    return fault


# name -> (fault, extra overrides for that launch, what the job's output must say)
FAULTS = {
    "SIGKILL rank 1": (signal_rank(1, signal.SIGKILL), (), "rank 0 lost its connection to another rank"),
    "SIGKILL rank 0": (signal_rank(0, signal.SIGKILL), (), "rank 1 lost its connection to another rank"),
    "SIGKILL the group": (kill_group, (), ""),
    "SIGKILL rank 0 during a save": (kill_rank_during_save(0), (), ""),
    "SIGKILL rank 1 during an async save": (kill_rank_during_save(1), ("train.async_save=true",), ""),
    "SIGTERM twice to the group": (sigterm_group_twice, (), "SIGTERM"),
    "SIGTERM to rank 1": (signal_rank(1, signal.SIGTERM), ("train.async_save=true",), "SIGTERM"),
    "SIGSTOP rank 1": (
        hang_rank(1),
        (f"train.collective_timeout_s={HUNG_TIMEOUT_S}",),
        f"rank 0 waited {HUNG_TIMEOUT_S} s (train.collective_timeout_s) in a collective for another rank: rank 1",
    ),
}


def mount_small_tmpfs(path: Path) -> bool:
    """A 64 MiB tmpfs at `path`, where the machine lets this process mount one."""
    path.mkdir(parents=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(path)]).returncode == 0


def fill_disk(path: Path) -> Path:
    """Leave 64 KiB free on `path`'s file system: less than one checkpoint of the tiny model."""
    filler = path / "filler"
    free = shutil.disk_usage(path).free
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * (free - 64 * 1024))
    return filler


def test_nine_seeded_faults_end_where_an_uninterrupted_run_ends(tmp_path, tiny_data):
    config = tiny_run_config(tiny_data, None, max_steps=STEPS, save_interval=SAVE_EVERY, keep_last=2, compile=False)
    paths = {}
    for name in ("reference", "soak"):
        config["train"]["out_dir"] = str(tmp_path / name)
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    reference_out, out = tmp_path / "reference", tmp_path / "soak"
    reference = Launch(paths["reference"], reference_out, tmp_path / "reference.log")
    assert reference.end() == 0, reference.text()

    rng = random.Random(SEED)
    order = list(FAULTS)
    rng.shuffle(order)
    has_tmpfs = mount_small_tmpfs(out / "checkpoints")
    if has_tmpfs:  # the disk fills up before the launch that follows the third fault
        order.insert(3, "disk full")
    try:
        for number, name in enumerate(order):
            resumed_at = int((read_latest(str(out / "checkpoints")) or "global_step0").removeprefix("global_step"))
            log = tmp_path / f"fault{number}.log"
            if name == "disk full":
                filler = fill_disk(out / "checkpoints")
                launch = Launch(paths["soak"], out, log)
                assert launch.end() != 0
                filler.unlink()
                text = launch.text()
                assert "could not save checkpoint" in text and "the disk is full" in text, text
                continue
            fault, overrides, says = FAULTS[name]
            launch = Launch(paths["soak"], out, log, *overrides)
            try:
                fault(launch, resumed_at + SAVE_EVERY + 1 + rng.randint(0, 1))
                code = launch.end()
            finally:
                launch.kill()
            assert code != 0 or "SIGTERM" in name, f"{name}: exit code {code}\n{launch.text()}"
            assert says in launch.text(), f"{name}\n{launch.text()}"
            assert "Traceback" not in launch.text() or name.startswith("SIGKILL"), f"{name}\n{launch.text()}"
        last = Launch(paths["soak"], out, tmp_path / "last.log")
        assert last.end() == 0, last.text()

        expected = {r["step"]: r["loss"] for r in records(reference_out) if "loss" in r}
        logged = [(r["step"], r["loss"]) for r in records(out) if "loss" in r]
        assert sorted({step for step, _ in logged}) == list(range(1, STEPS + 1))
        assert [loss for _, loss in logged] == [expected[step] for step, _ in logged]
        assert consumed_samples(out) == consumed_samples(reference_out)
        want, got = final_weights(reference_out), final_weights(out)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
    finally:
        if has_tmpfs:
            subprocess.run(["umount", "-l", str(out / "checkpoints")])
