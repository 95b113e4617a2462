"""Elastic training through torchrun's elastic agent (launch/elastic.sh): two agents on this
machine stand for two nodes of one process each. One is killed: the survivor re-rendezvouses and
resumes from the newest complete checkpoint on 1 rank by itself; the agent started again joins,
and the run grows back to 2 ranks. From the metrics: every step's samples follow the previous
step's (the consumed-sample count is carried over every restart), so each sample is consumed once.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import tiny_run_config

from llmstack.net import free_port

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN, MICRO = 32, 4
PHASE_TIMEOUT_S = 300  # a guard against a hang, not a performance bound


class Agent:
    """One `launch/elastic.sh` (a torchrun elastic agent and its worker), in its own process group."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        command = ["bash", str(REPO / "launch/elastic.sh"), "--ds", "zero1", "--config", str(config)]
        command += ["--num_gpus", "1", "--master_port", str(port), "--max_restarts", "3"]
        command += ["--rdzv_conf", "last_call_timeout=1"]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        """Kill the agent and its worker, as a node failure would (the agent starts its workers
        in sessions of their own, so the worker is found through the agent's children)."""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children first), from /proc (Linux)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


def latest_checkpoint(out_dir: Path) -> tuple[int, int]:
    """(step, data-parallel size) of the newest complete checkpoint; (0, 0) before the first."""
    root = out_dir / "checkpoints"
    try:
        tag = (root / "latest").read_text()
        state = json.loads((root / tag / "llmstack_state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0, 0
    return state["step"], state["data_parallel_size"]


def saved_by_two_after(out_dir: Path, step: int) -> bool:
    newest, data_parallel_size = latest_checkpoint(out_dir)
    return newest > step and data_parallel_size == 2


def wait_for(condition, agents, log: Path) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not condition():
        exited = [a.process.returncode for a in agents if a.process.poll() is not None]
        if exited or time.monotonic() > deadline:
            raise AssertionError(f"agents exited with {exited} or timed out; log:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)


def lineage(out_dir: Path) -> dict[int, int]:
    """{step: samples consumed after it} of the run as it stands: a step trained again after a
    restart (the steps since the checkpoint it resumed from) counts in its last version."""
    consumed = {}
    with open(out_dir / "metrics.jsonl") as f:
        for record in map(json.loads, f):
            if "tokens_seen" in record:
                consumed[record["step"]] = record["tokens_seen"] // SEQ_LEN
    return consumed


def test_a_node_leaves_and_comes_back_and_every_sample_is_consumed_once(tmp_path, tiny_data):
    out_dir = tmp_path / "run"
    raw = tiny_run_config(
        tiny_data,
        out_dir,
        max_steps=100_000,
        save_interval=2,
        micro_batch_size=MICRO,
        grad_accum_steps=1,
        compile=False,  # a long run, which `auto` would compile; the agents stop it early
    )
    config, log = tmp_path / "run.yaml", tmp_path / "agents.log"
    config.write_text(yaml.safe_dump(raw))
    port = free_port()
    first = Agent(config, port, log)  # hosts the rendezvous store, so it is the one that stays
    time.sleep(1)
    second = Agent(config, port, log)
    agents = [first, second]
    try:
        wait_for(lambda: latest_checkpoint(out_dir)[1] == 2, agents, log)
        second.kill()
        agents = [first]
        wait_for(lambda: latest_checkpoint(out_dir)[1] == 1, agents, log)
        shrunk_at = latest_checkpoint(out_dir)[0]
        second = Agent(config, port, log)
        agents = [first, second]
        wait_for(lambda: saved_by_two_after(out_dir, shrunk_at), agents, log)
    finally:
        for agent in (first, second):
            agent.kill()

    consumed = lineage(out_dir)
    steps = sorted(consumed)
    assert steps == list(range(1, len(steps) + 1))
    batches = [consumed[s] - consumed.get(s - 1, 0) for s in steps]
    # Each step consumed the global batch of the ranks that trained it (4 samples per rank), right
    # after the previous step's: nothing skipped, nothing read twice.
    assert set(batches) == {MICRO, 2 * MICRO}, batches
    ranks = [b // MICRO for b in batches]
    shrink = ranks.index(1, ranks.index(2))
    assert 2 in ranks[shrink:], ranks  # 2 ranks, then 1 (a node lost), then 2 again (it came back)


def test_the_script_command_parses_as_an_elastic_torchrun_that_resumes(tmp_path):
    from torch.distributed.run import get_args_parser

    config = tmp_path / "run.yaml"
    config.write_text("model: {}\n")
    result = subprocess.run(
        ["bash", str(REPO / "launch/elastic.sh"), "--ds", "zero2", "--config", str(config), "--num_gpus", "8"]
        + ["--master_addr", "node1", "--min_nodes", "2", "--max_nodes", "4", "--dry-run", "train.lr=1e-4"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(command[3:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint) == ("2:4", "8", "node1:29500")
    assert args.rdzv_backend == "c10d"
    assert args.max_restarts == 100 and args.module and args.training_script == "llmstack"
    assert args.training_script_args[-3:] == ["--resume", "auto", "train.lr=1e-4"]
