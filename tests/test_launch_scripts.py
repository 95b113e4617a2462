"""The launch scripts' commands (--dry-run), checked against the launchers' own argument parsers."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from deepspeed.launcher.runner import parse_args as parse_deepspeed_args
from torch.distributed.run import get_args_parser as torchrun_parser

REPO = Path(__file__).resolve().parents[1]
PRETRAIN, TORCHRUN, SLURM = REPO / "launch/pretrain.sh", REPO / "launch/torchrun.sh", REPO / "launch/slurm.sbatch"


@pytest.fixture
def files(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {}\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=8\nnode2 slots=8\nnode3 slots=8\n")
    return config, hostfile


def script(path, *args, env=None, cwd=None):
    return subprocess.run(
        ["bash", str(path), *map(str, args)], capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd
    )


def dry_run(path, *args, **kwargs):
    result = script(path, *args, "--dry-run", **kwargs)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines()]


def train_args(config, ds="zero2"):
    return ["train", "--config", str(config), "--ds-config", str(REPO / f"ds_configs/{ds}.json")]


def test_pretrain_single_node(files):
    config, _ = files
    overrides = ["train.lr=3e-4", "data.train=[a, b]"]
    (cmd,) = dry_run(PRETRAIN, "--ds", "zero2", "--config", config, "--num_gpus", 2, *overrides)
    assert cmd == [
        "deepspeed", "--num_gpus", "2", "--master_port", "29500", "--no_local_rank", "--module", "llmstack",
        *train_args(config), *overrides,
    ]  # fmt: skip
    args = parse_deepspeed_args(cmd[1:])
    assert (args.num_gpus, args.module, args.no_local_rank, args.user_script) == (2, True, True, "llmstack")
    assert args.user_args == [*train_args(config), *overrides]


def test_pretrain_multi_node_with_a_hostfile(files):
    config, hostfile = files
    (cmd,) = dry_run(
        PRETRAIN, "--ds", "zero3_offload", "--config", config, "--hostfile", hostfile, "--num_nodes", 2,
        "--num_gpus", 8, "--master_addr", "10.0.0.1", "--master_port", 6000,
    )  # fmt: skip
    assert cmd == [
        "deepspeed", "--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "8", "--master_addr", "10.0.0.1",
        "--master_port", "6000", "--no_local_rank", "--module", "llmstack", *train_args(config, "zero3_offload"),
    ]  # fmt: skip
    args = parse_deepspeed_args(cmd[1:])
    assert (args.hostfile, args.num_nodes, args.master_addr, args.master_port) == (str(hostfile), 2, "10.0.0.1", 6000)


def test_torchrun_single_node(files):
    config, _ = files
    (cmd,) = dry_run(TORCHRUN, "--ds", "zero1", "--config", config, "--num_gpus", 2, "train.max_steps=10")
    assert cmd == ["torchrun", "--nproc_per_node", "2", "--standalone", "-m", "llmstack", *train_args(config, "zero1"),
                   "train.max_steps=10"]  # fmt: skip
    args = torchrun_parser().parse_args(cmd[1:])
    assert (args.standalone, args.module, args.training_script) == (True, True, "llmstack")


def test_torchrun_multi_node_starts_one_rendezvous_command_per_host(files, tmp_path):
    config, hostfile = files
    lines = dry_run(TORCHRUN, "--ds", "zero2", "--config", config, "--hostfile", hostfile, "--num_nodes", 2,
                    "--num_gpus", 8, cwd=tmp_path)  # fmt: skip
    assert [line[:2] for line in lines] == [["ssh", "node1"], ["ssh", "node2"]]
    node_command = f"cd {tmp_path} && " + shlex.join(
        ["torchrun", "--nproc_per_node", "8", "--nnodes", "2", "--rdzv_backend", "c10d",
         "--rdzv_endpoint", "node1:29500", "--rdzv_id", "llmstack", "-m", "llmstack", *train_args(config)]
    )  # fmt: skip
    for line in lines:
        (remote,) = line[2:]
        assert remote == node_command
        args = torchrun_parser().parse_args(shlex.split(remote)[4:])
        assert (args.nnodes, args.rdzv_endpoint, args.nproc_per_node) == ("2", "node1:29500", "8")


def test_slurm_example_builds_the_hostfile_from_the_job_nodes(files, tmp_path):
    config, _ = files
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    scontrol = '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu-[07-08]" ] && printf "gpu-07\\ngpu-08\\n"\n'
    (fake_bin / "scontrol").write_text(scontrol)
    (fake_bin / "scontrol").chmod(0o755)
    job = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_DIR": str(REPO), "TMPDIR": str(tmp_path),
           "PATH": f"{fake_bin}:{os.environ['PATH']}", "DS": "zero3", "CONFIG": str(config)}  # fmt: skip
    (cmd,) = dry_run(SLURM, "train.lr=1e-4", env=job)
    hostfile = tmp_path / "hostfile.42"
    assert hostfile.read_text() == "gpu-07 slots=4\ngpu-08 slots=4\n"
    assert cmd == [
        "deepspeed", "--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "4", "--master_addr", "gpu-07",
        "--master_port", "29500", "--no_local_rank", "--module", "llmstack", *train_args(config, "zero3"),
        "train.lr=1e-4",
    ]  # fmt: skip


@pytest.mark.parametrize("path", [PRETRAIN, TORCHRUN], ids=["pretrain", "torchrun"])
def test_launch_errors_name_what_is_missing(path, files, tmp_path):
    config, hostfile = files
    cases = [
        (["--ds", "zero2"], "--config is required"),
        (["--ds", "zero2", "--config", tmp_path / "nope.yaml"], f"run config {tmp_path / 'nope.yaml'} not found"),
        (["--config", config], r"--ds is required: one of .*\bzero1 zero2\b"),
        (["--ds", "zero9", "--config", config], r"no DeepSpeed config .*zero9.json; choose one of: .*\bzero1 zero2\b"),
        (["--ds", "zero2", "--config", config, "--hostfile", tmp_path / "nohosts"], "hostfile .*nohosts not found"),
        (["--ds", "zero2", "--config", config, "--num_nodes", 2], "--num_nodes 2 needs"),
        (["--ds", "zero2", "--config", config, "--nodes", 2], "unknown option --nodes"),
    ]
    for args, message in cases:
        result = script(path, *args, "--dry-run")
        assert result.returncode == 2 and result.stdout == "", (args, result.stdout)
        assert re.search(message, result.stderr), (args, result.stderr)
