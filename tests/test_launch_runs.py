"""Real 2-rank CPU training through each launcher: launch/pretrain.sh (deepspeed), launch/torchrun.sh
and `accelerate launch` with launch/accelerate_deepspeed.yaml. Same run config, same seed, same
ds_config: the three runs must log the same losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_config

from llmstack.testing import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS, MICRO_BATCH, SEQ_LEN, RANKS = 2, 4, 32, 2

# Trains like `llmstack train --config RUN --ds-config DS` (leaving the process group together) and
# records which global samples each rank's training batches held, and the process group it ran in.
RECORDING_TRAIN = """
import json, os, sys
import torch.distributed as dist
from llmstack.training import Trainer, load_run_config
from llmstack.training.distributed import shutdown_distributed

run = load_run_config(sys.argv[1])
run.data.prefetch = 0  # record the samples training takes, not those a reader thread reads ahead
trainer = Trainer(run, ds_config_path=sys.argv[2])
samples, sample = [], trainer.train_data.sample

def recording_sample(i):
    samples.append(i)
    return sample(i)

trainer.train_data.sample = recording_sample
trainer.train()
with open(os.path.join(run.train.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"world_size": dist.get_world_size(), "samples": samples}, f)
shutdown_distributed()  # as `llmstack train` does: a rank leaving early makes gloo abort its peer
"""


@pytest.fixture(scope="module")
def run_config(tiny_data, tmp_path_factory):
    """Write the run config for one launcher; returns (config path, out_dir)."""

    def write(name):
        root = tmp_path_factory.mktemp(name)
        raw = tiny_run_config(tiny_data, root / "out", max_steps=STEPS, micro_batch_size=MICRO_BATCH, log_interval=1)
        (root / "run.yaml").write_text(yaml.safe_dump(raw))
        return root / "run.yaml", root / "out"

    return write


def launch(cmd):
    # The scripts run `deepspeed` / `torchrun` as a user's shell would; this interpreter's own
    # launchers come first on PATH, so the test needs no activated virtualenv.
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def losses(out_dir):
    """{step: loss} of a finished run, after checking that it trained on RANKS data-parallel ranks."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["tokens_seen"] == STEPS * MICRO_BATCH * RANKS * SEQ_LEN
    return {r["step"]: r["loss"] for r in train}


@pytest.fixture(scope="module")
def deepspeed_run(run_config):
    config, out_dir = run_config("deepspeed")
    port = free_port()
    result = launch(["bash", "launch/pretrain.sh", "--ds", "zero2", "--config", config, "--num_gpus", "2",
                     "--master_port", str(port)])  # fmt: skip
    return result, config, out_dir


def test_pretrain_sh_trains_two_cpu_ranks_and_prints_its_command(deepspeed_run):
    result, config, out_dir = deepspeed_run
    printed = result.stdout.splitlines()[0]
    assert printed.startswith("deepspeed --num_gpus 2 --master_port ")
    assert printed.endswith(f"--module llmstack train --config {config} --ds-config {REPO}/ds_configs/zero2.json")
    assert sorted(losses(out_dir)) == [1, 2]


def test_torchrun_sh_trains_the_same_run(deepspeed_run, run_config):
    config, out_dir = run_config("torchrun")
    result = launch(["bash", "launch/torchrun.sh", "--ds", "zero2", "--config", config, "--num_gpus", "2"])
    assert result.stdout.startswith("torchrun --nproc_per_node 2 --standalone -m llmstack train")
    assert losses(out_dir) == pytest.approx(losses(deepspeed_run[2]), rel=1e-5)


def test_accelerate_launch_trains_two_processes_on_disjoint_data(deepspeed_run, run_config):
    config, out_dir = run_config("accelerate")
    script = out_dir.parent / "recording_train.py"
    script.write_text(RECORDING_TRAIN)
    launch([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
            "--config_file", "launch/accelerate_deepspeed.yaml", "--main_process_port", str(free_port()),
            str(script), str(config), "ds_configs/zero2.json"])  # fmt: skip
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    seen = [set(r["samples"]) for r in ranks]
    assert all(len(s) == STEPS * MICRO_BATCH for s in seen)
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(2 * STEPS * MICRO_BATCH))
    assert losses(out_dir) == pytest.approx(losses(deepspeed_run[2]), rel=1e-5)


def test_accelerate_config_uses_the_deepspeed_plugin_with_a_ds_config_file():
    accelerate_config = yaml.safe_load((REPO / "launch/accelerate_deepspeed.yaml").read_text())
    assert accelerate_config["distributed_type"] == "DEEPSPEED"
    assert "mixed_precision" not in accelerate_config
    assert (REPO / accelerate_config["deepspeed_config"]["deepspeed_config_file"]).is_file()
    assert os.path.dirname(accelerate_config["deepspeed_config"]["deepspeed_config_file"]) == "ds_configs"
