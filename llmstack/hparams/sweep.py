"""Running a sweep: each trial an ordinary `llmstack train` run in its own directory, started as a
subprocess, one after another or `parallel` at once; the results table kept as they finish.

    SWEEP_DIR/sweep.json       what was asked (config, steps, overrides, the trials): a rerun with
                               other arguments into the same directory is refused
    SWEEP_DIR/results.jsonl    one row per finished trial (validation and training loss, status)
    SWEEP_DIR/trials/t000/     the trial's run directory (metrics.jsonl, checkpoints)
    SWEEP_DIR/logs/t000.log    its stdout and stderr

A killed sweep continues where it stopped: a trial with a row in the table is done (failed ones
too: delete the row to run one again). A trial without a row is restarted from scratch, its
run directory removed first, rather than resumed from a checkpoint: a proxy run is short, and a
fresh start gives the same numbers as an uninterrupted one, while a resumed run need not (DeepSpeed's
CPU Adam recomputes its bias corrections after a load and drifts by ~1e-7). Every trial starts
from the run config's seeds, so the table does not depend on where the sweep was stopped.
"""

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from tqdm import tqdm

from llmstack.errors import UserError
from llmstack.monitor.plot import read_metrics, series

SWEEP_FILE = "sweep.json"
RESULTS_FILE = "results.jsonl"
PLOT_FILE = "sweep.png"
# What the sweep sets in every trial; sweeping these would break it.
OWNED_KEYS = ("train.max_steps", "train.out_dir")
POINTS_PER_CURVE = 25  # train.log_interval is set so that each loss curve has about this many points


@dataclass
class Sweep:
    """What a sweep runs: `trials` (each {section.key: value}) of `steps` steps on `config`, with
    `overrides` (section.key=value) applied to every trial before the trial's own."""

    config: str
    steps: int
    trials: list[dict[str, str]]
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1; got {self.steps}")
        for key in {k for trial in self.trials for k in trial} | {o.partition("=")[0] for o in self.overrides}:
            if key in OWNED_KEYS:
                raise UserError(
                    f"{key} is set by the sweep for each trial (--steps, --out): do not sweep or override it"
                )

    def name(self, index: int) -> str:
        return f"t{index:03d}"

    def trial_overrides(self, index: int, out_dir: str) -> list[str]:
        """The overrides of trial `index`: a logging interval for the curves, the sweep's overrides,
        the trial's values, then its length and run directory."""
        return [
            f"train.log_interval={max(1, self.steps // POINTS_PER_CURVE)}",
            *self.overrides,
            *(f"{k}={v}" for k, v in self.trials[index].items()),
            f"train.max_steps={self.steps}",
            f"train.out_dir={run_dir(out_dir, self.name(index))}",
        ]


def run_dir(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, "trials", name)


def check_trials(sweep: Sweep, out_dir: str) -> None:
    """Load every trial's run config (unknown keys, bad values, a missing file are UserErrors now,
    before any trial starts); the ranking needs validation data."""
    from llmstack.training.config import load_run_config

    for index in range(len(sweep.trials)):
        config = load_run_config(sweep.config, sweep.trial_overrides(index, out_dir))
        if not config.data.valid:
            raise UserError(f"{sweep.config} has no data.valid: a sweep ranks its trials by validation loss")


def check_manifest(sweep: Sweep, out_dir: str) -> None:
    """Write sweep.json, or check that the one there describes this sweep."""
    path = os.path.join(out_dir, SWEEP_FILE)
    wanted = asdict(sweep)
    if os.path.isfile(path):
        with open(path) as f:
            found = json.load(f)
        if found != wanted:
            differ = ", ".join(k for k in wanted if found.get(k) != wanted[k])
            raise UserError(
                f"{out_dir} holds another sweep ({SWEEP_FILE} differs in: {differ}): give the same arguments "
                "to continue it, or another --out"
            )
        return
    os.makedirs(out_dir, exist_ok=True)
    _write_atomic(path, json.dumps(wanted, indent=1) + "\n")


def read_results(out_dir: str) -> dict[str, dict[str, Any]]:
    """{trial name: row} of the results table; a line cut off by a kill is dropped."""
    path = os.path.join(out_dir, RESULTS_FILE)
    rows: dict[str, dict[str, Any]] = {}
    if not os.path.isfile(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row["trial"]] = row
    return rows


def write_results(out_dir: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """The whole table, in trial order (written atomically)."""
    text = "".join(json.dumps(row) + "\n" for row in sorted(rows, key=lambda r: r["trial"]))
    _write_atomic(os.path.join(out_dir, RESULTS_FILE), text)


def _append_result(out_dir: str, row: Mapping[str, Any]) -> None:
    with open(os.path.join(out_dir, RESULTS_FILE), "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def trial_row(sweep: Sweep, index: int, out_dir: str, returncode: int, wall_s: float) -> dict[str, Any]:
    """The table row of a finished trial: its final validation loss (status ok), or why there is none."""
    name = sweep.name(index)
    row: dict[str, Any] = {"trial": name, "overrides": sweep.trials[index], "status": "failed"}
    row.update(val_loss=None, train_loss=None, steps=0, returncode=returncode, wall_s=round(wall_s, 1))
    row["run_dir"] = run_dir(out_dir, name)
    try:
        records = read_metrics(row["run_dir"])
    except UserError:
        return row
    val_steps, val_losses = series(records, "val_loss")
    train_steps, train_losses = series(records, "loss")
    row["steps"] = max((r["step"] for r in records), default=0)
    row["train_loss"] = train_losses[-1] if train_losses else None
    if returncode == 0 and val_steps and val_steps[-1] == sweep.steps:
        row.update(status="ok", val_loss=val_losses[-1])
    elif returncode == 0:
        row["status"] = "diverged"  # finished without a finite validation loss at the last step
    return row


def ranked(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Trials by validation loss, lowest first; trials without one last, in trial order."""
    return sorted(rows, key=lambda r: (r["val_loss"] is None, r["val_loss"] or 0.0, r["trial"]))


def best_overrides(rows: Iterable[Mapping[str, Any]]) -> str:
    """The winner's overrides as one shell-quoted line for `llmstack train`."""
    ok = [r for r in ranked(rows) if r["status"] == "ok"]
    if not ok:
        raise UserError("no trial finished with a validation loss: see the logs under the sweep directory")
    return shlex.join(f"{k}={v}" for k, v in ok[0]["overrides"].items())


def format_ranking(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str:
    """A plain-text table: rank, trial, validation and training loss, status, the swept values."""
    header = ["rank", "trial", "val_loss", "train_loss", "status", *keys]
    lines = [header]
    for rank, row in enumerate(ranked(rows), 1):
        lines.append(
            [
                str(rank),
                row["trial"],
                _number(row["val_loss"]),
                _number(row["train_loss"]),
                row["status"],
                *(str(row["overrides"].get(k, "")) for k in keys),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _number(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def trial_environment(parallel: int, slot: int, gpus: Sequence[str]) -> dict[str, str]:
    """The environment of the trial in `slot` (0 to parallel-1): its share of the CPU threads (unless
    OMP_NUM_THREADS is set) and, with trials in parallel on GPUs, a GPU of its own (round robin)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    if parallel > 1 and gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    return env


def visible_gpus() -> list[str]:
    """The CUDA devices trials may use (none on a CPU machine)."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def run_sweep(sweep: Sweep, out_dir: str, parallel: int = 1, poll_s: float = 0.2) -> list[dict[str, Any]]:
    """Run the trials the table lacks (`parallel` at once) and return every row, in trial order.
    An interrupt (Ctrl-C, or SIGTERM turned into KeyboardInterrupt by the CLI) stops the running
    trials; their rows stay missing, so the next run restarts them."""
    if parallel < 1:
        raise UserError(f"--parallel must be at least 1; got {parallel}")
    check_trials(sweep, out_dir)
    check_manifest(sweep, out_dir)
    rows = read_results(out_dir)
    write_results(out_dir, rows.values())  # drops a line a kill cut off, so appends start on a new line
    pending = [i for i in range(len(sweep.trials)) if sweep.name(i) not in rows]
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    gpus = visible_gpus()
    running: dict[int, tuple[subprocess.Popen[bytes], float, IO[bytes], int]] = {}
    bar = tqdm(total=len(sweep.trials), initial=len(sweep.trials) - len(pending), desc="sweep", unit="trial")
    bar.set_postfix_str(_best_text(rows.values()))
    try:
        while pending or running:
            while pending and len(running) < parallel:
                index = pending.pop(0)
                slot = min(set(range(parallel)) - {r[3] for r in running.values()})
                env = trial_environment(parallel, slot, gpus)
                running[index] = (*_start_trial(sweep, index, out_dir, env), slot)
            for index, (proc, start, log, _) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[index]
                row = trial_row(sweep, index, out_dir, proc.returncode, time.monotonic() - start)
                _append_result(out_dir, row)
                rows[row["trial"]] = row
                bar.update(1)
                bar.set_postfix_str(_best_text(rows.values()))
            time.sleep(poll_s)
    finally:
        for proc, _, log, _ in running.values():
            _stop(proc)
            log.close()
        bar.close()
    write_results(out_dir, rows.values())
    return sorted(rows.values(), key=lambda r: r["trial"])


def _start_trial(
    sweep: Sweep, index: int, out_dir: str, env: Mapping[str, str]
) -> tuple[subprocess.Popen[bytes], float, IO[bytes]]:
    shutil.rmtree(run_dir(out_dir, sweep.name(index)), ignore_errors=True)  # an interrupted attempt
    command = [sys.executable, "-m", "llmstack", "train", "--config", sweep.config]
    command += sweep.trial_overrides(index, out_dir)
    log = open(os.path.join(out_dir, "logs", f"{sweep.name(index)}.log"), "wb")
    log.write(f"$ {shlex.join(command)}\n".encode())
    log.flush()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    return proc, time.monotonic(), log


def _stop(proc: subprocess.Popen[bytes], wait_s: float = 10.0) -> None:
    """Stop a running trial: SIGTERM, then SIGKILL if it does not exit in `wait_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _best_text(rows: Iterable[Mapping[str, Any]]) -> str:
    ok = [r for r in ranked(rows) if r["status"] == "ok"]
    return f"best val_loss {ok[0]['val_loss']:.4f} ({ok[0]['trial']})" if ok else ""


def grid_heatmap(rows: Iterable[Mapping[str, Any]], choices: Sequence[Any]) -> Any:
    """The Heatmap of a two-dimensional grid's validation losses (None for any other sweep)."""
    from llmstack.monitor.plot import Heatmap

    if len(choices) != 2:
        return None
    first, second = choices
    losses = {(r["overrides"].get(first.key), r["overrides"].get(second.key)): r["val_loss"] for r in rows}
    values = [[losses.get((a, b)) for b in second.values] for a in first.values]
    return Heatmap(first.key, first.values, second.key, second.values, values)


def plot_results(rows: Sequence[Mapping[str, Any]], out_dir: str, heatmap: Any = None) -> str:
    """SWEEP_DIR/sweep.png: every trial's loss curve, and the heat map if given."""
    from llmstack.monitor.plot import plot_sweep

    runs = [(f"{r['trial']} {' '.join(f'{k}={v}' for k, v in r['overrides'].items())}", r["run_dir"]) for r in rows]
    return str(plot_sweep(runs, os.path.join(out_dir, PLOT_FILE), heatmap))
