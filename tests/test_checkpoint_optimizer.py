"""Every shipped ds_config resumes bit-exactly: the optimizer DeepSpeed builds from it, reloaded
with the state it had after any step k, ends where the run that never stopped ends.

DeepSpeed's own CPU Adam kernels (DeepSpeedCPUAdam, and FusedAdam under the CPU accelerator) do
not: their bias correction beta^t is a float running product in a run that never stopped but
std::pow(beta, t) after a load (cpu_adam.h, IncrementStep), and the two differ in the last bit at
some steps (for beta2 = 0.95 at t = 6, 7, 8, 10, ...). Checked on this machine: with betas
(0.9, 0.95), resuming either kernel after step 5, 6, 7 or 9-18 of a 30-step run changes the final
weights, where torch's AdamW (fused or foreach) matches from every step. So the shipped configs
choose torch's fused AdamW ("torch_adam": true, "fused": true), which computes beta^t from the
step count at every step.
"""

import copy
import glob
import json

import pytest
import torch
from conftest import TINY_MODEL

from llmstack.testing import run_distributed

STEPS = 30


def optimizer_type(path):
    with open(path) as f:
        return json.load(f)["optimizer"]["type"]


SHIPPED = sorted(p for p in glob.glob("ds_configs/*.json") if optimizer_type(p) == "AdamW")


def resume_points_that_drift(optimizer, steps=STEPS, size=4096):
    """The steps k in 1..steps-1 after which reloading the optimizer's state (and the weights)
    and stepping on does not end bit-identical to the uninterrupted run.

    The optimizer steps a probe parameter of its own (ZeRO-3 hands its optimizer the partitions
    only inside a step) with its first parameter group's hyperparameters at lr 1e-3. The same
    optimizer object is reloaded, as a resumed process loads a new one: DeepSpeed's C++ kernels
    keep their step count outside the state dict, and a load that jumps it takes their std::pow path."""
    probe = torch.nn.Parameter(torch.linspace(-1, 1, size))
    optimizer.param_groups = [{**optimizer.param_groups[0], "params": [probe], "lr": 1e-3}]
    optimizer.state.clear()
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(size, generator=generator) * 1e-2 for _ in range(steps)]

    def run(start, weights, state):
        with torch.no_grad():
            probe.copy_(weights)
        optimizer.load_state_dict(copy.deepcopy(state))
        saved = {}
        for t in range(start, steps):
            probe.grad = grads[t].clone()
            optimizer.step()
            saved[t + 1] = (probe.detach().clone(), copy.deepcopy(optimizer.state_dict()))
        return saved

    full = run(0, probe.detach().clone(), optimizer.state_dict())
    return [k for k in range(1, steps) if not torch.equal(run(k, *full[k])[steps][0], full[steps][0])]


def build_optimizers(rank, world_size, paths):
    """{ds_config: (optimizer class, fused, resume points that drift)} for a tiny model on 1 rank."""
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.optim.deepspeed_integration import initialize
    from llmstack.training.config import TrainConfig
    from llmstack.training.ds_config import complete_ds_config, load_ds_config
    from llmstack.training.precision import enable_fp16_on_cpu

    enable_fp16_on_cpu()  # the fp16 configs: DeepSpeed's CPU accelerator refuses fp16 otherwise
    results = {}
    for path in paths:
        model = LLMStackForCausalLM(LLMStackConfig(vocab_size=128, **TINY_MODEL))
        config = complete_ds_config(load_ds_config(path), TrainConfig(micro_batch_size=1), dp_size=1)
        engine, *_ = initialize(model, config, model.parameters())
        optimizer = engine.basic_optimizer
        results[path] = (type(optimizer).__name__, optimizer.defaults.get("fused"), resume_points_that_drift(optimizer))
        engine.destroy()
    return results


@pytest.fixture(scope="module")
def shipped_optimizers():
    return run_distributed(build_optimizers, 1, args=(SHIPPED,))[0]


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_ds_config_optimizer_resumes_bit_exactly_from_every_step(shipped_optimizers, path):
    name, fused, drifting = shipped_optimizers[path]
    assert (name, fused) == ("AdamW", True), "the ds_config should choose torch's fused AdamW (see the module doc)"
    assert drifting == [], f"resuming after these steps changes the weights: {drifting}"
