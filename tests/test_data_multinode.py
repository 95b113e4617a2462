"""A cleaning job split into tasks (a SLURM array): each task filters and writes its share of the
shards, key-range merge tasks find duplicate pairs, one task clusters them. 1 task and 4 tasks
keep exactly the same documents, and a killed task reruns alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_pipeline import prose

from llmstack.cli.main import main
from llmstack.data.pipeline import PHASES, run_pipeline
from llmstack.errors import UserError

NUM_TASKS = 4


def long_prose(i):
    return prose(i, sentences=16)  # 176 words: one changed word leaves Jaccard 0.94, LSH misses it with p ~ 1e-6


def corpus(tmp_path):
    """9 files; duplicates (exact and near) of documents in other files, so dedup must be global."""
    paths = []
    for f in range(9):
        docs = [long_prose(10 * f + d) for d in range(3)]
        if f:
            docs.append(long_prose(10 * (f - 1)).upper())  # an exact duplicate (case) of the previous file's first
            docs.append(long_prose(10 * (f - 1) + 1).replace(" sold the flour ", " sold their flour ", 1))  # near
        path = tmp_path / f"in-{f}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        paths.append(str(path))
    return paths


def config(paths, output):
    return {
        "inputs": [{"paths": paths}],
        "output": str(output),
        "stages": ["normalize", "pii"],
        "dedup": {"exact": True, "near": {}, "paragraphs": {"min_chars": 20}, "max_in_memory": 16},
    }


def clean_files(output):
    return {p.name: p.read_text() for p in sorted((Path(output) / "clean").glob("shard-*.jsonl"))}


def run_tasks(job, tasks=range(NUM_TASKS), phases=PHASES):
    for phase in phases:
        for task in tasks if phase not in ("cluster", "report") else [0]:
            run_pipeline(job, show=lambda _: None, task=task, num_tasks=NUM_TASKS, phase=phase)


def test_four_tasks_keep_exactly_what_one_task_keeps(tmp_path):
    paths = corpus(tmp_path)
    one = run_pipeline(config(paths, tmp_path / "one"), show=lambda _: None)
    run_tasks(config(paths, tmp_path / "four"))
    assert clean_files(tmp_path / "four") == clean_files(tmp_path / "one")
    assert one["dedup"].drops == {"exact_duplicate": 8, "near_duplicate": 8}
    report = json.loads((tmp_path / "four" / "report.json").read_text())
    assert report["stages"]["dedup"]["drops"] == one["dedup"].to_dict()["drops"]


def test_a_killed_task_reruns_alone(tmp_path):
    paths = corpus(tmp_path)
    job = config(paths, tmp_path / "job")
    run_tasks(job)
    expected = clean_files(tmp_path / "job")
    clean = tmp_path / "job" / "clean"
    for shard in (1, 5):  # task 1's shards, as if it died in the write phase
        (clean / f"shard-{shard:05d}.stats.json").unlink()
    (clean / "shard-00005.jsonl").rename(clean / "shard-00005.jsonl.tmp-node7-123")  # half-written
    untouched = (clean / "shard-00000.stats.json").stat().st_mtime_ns
    run_tasks(job, tasks=[1], phases=["write"])
    assert clean_files(tmp_path / "job") == expected and not list(clean.glob("*.tmp-*"))
    assert (clean / "shard-00000.stats.json").stat().st_mtime_ns == untouched


def test_phases_in_the_wrong_order_and_bad_tasks_are_user_errors(tmp_path):
    job = config(corpus(tmp_path), tmp_path / "job")
    with pytest.raises(UserError, match="--phase"):
        run_pipeline(job, task=0, num_tasks=2)
    with pytest.raises(UserError, match="--task"):
        run_pipeline(job, task=2, num_tasks=2, phase="filter")
    run_pipeline(job, task=0, num_tasks=2, phase="filter")
    with pytest.raises(UserError, match="filter phase has not finished shards"):
        run_pipeline(job, task=0, num_tasks=2, phase="merge")


def test_cli_runs_one_phase_of_one_task(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps(config(corpus(tmp_path), tmp_path / "job")))
    args = ["data", "clean", "--config", str(path), "--num-tasks", "3", "--task", "2", "--phase", "filter"]
    assert main(args) == 0
    done = sorted(p.name for p in (tmp_path / "job" / "filtered").glob("*.stats.json"))
    assert done == ["shard-00002.stats.json", "shard-00005.stats.json", "shard-00008.stats.json"]


def test_sbatch_chain_runs_the_phases_in_order_as_arrays(tmp_path):
    """launch/data_clean.sbatch submits five dependent jobs; running them as SLURM would (each array
    index in turn) keeps what one task keeps."""
    repo = Path(__file__).resolve().parents[1]
    paths = corpus(tmp_path)
    one = tmp_path / "one"
    run_pipeline(config(paths, one), show=lambda _: None)
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(config(paths, tmp_path / "job")))
    fake_bin, log = tmp_path / "bin", tmp_path / "sbatch.log"
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {log}\nwc -l < {log}\n')  # job id: the line number
    (fake_bin / "sbatch").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "CONFIG": str(job),
        "TASKS": "2",
        "PYTHON": sys.executable,
    }
    env.pop("SLURM_JOB_ID", None)
    submitted = subprocess.run(
        ["bash", str(repo / "launch/data_clean.sbatch")], env=env, capture_output=True, text=True, check=True
    )
    assert submitted.stdout.split("\n")[0] == "filter: job 1"
    jobs = [line.split() for line in log.read_text().splitlines()]
    assert [a for a in jobs[1] if a.startswith("--dependency")] == ["--dependency=afterok:1"]
    for number, args in enumerate(jobs, 1):
        export = dict(kv.split("=", 1) for kv in next(a for a in args if a.startswith("--export=")).split(",")[1:])
        array = next((a.split("=")[1] for a in args if a.startswith("--array=")), None)
        assert (export["PHASE"], array) == (
            PHASES[number - 1],
            "0-1" if PHASES[number - 1] in ("filter", "merge", "write") else None,
        )
        for index in range(2) if array else [None]:
            task_env = {**env, **export, "SLURM_JOB_ID": str(number), "SLURM_SUBMIT_DIR": str(repo)}
            if index is not None:
                task_env["SLURM_ARRAY_TASK_ID"] = str(index)
            subprocess.run(["bash", args[-1]], env=task_env, check=True, capture_output=True)
    assert clean_files(tmp_path / "job") == clean_files(one)
