"""Expert parallelism through the trainer (2 gloo ranks, fp32): a run whose experts are split over
2 ranks (train.expert_parallel_size 2) trains as the same run with every expert on every rank,
through DeepSpeed's engine at ZeRO stages 0 and 2; its checkpoints hold every rank's experts,
resume exactly, refuse another expert-parallel size, and export to one stock Mixtral model that
computes as the run's own weights gathered in memory (not the expert-parallel-1 run's: the final
weights of the two drift apart by Adam-amplified rounding, see tests/test_moe_tp_training.py); the
trainer's communication metrics count its all-to-alls."""

import json

import torch
from conftest import tiny_run_config
from transformers import MixtralForCausalLM

from llmstack.cli.main import main
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.parallel.expert_parallel import all_to_all_bytes
from llmstack.testing import run_distributed

MOE = {"num_local_experts": 4, "num_experts_per_tok": 2, "router_z_loss_coef": 0.001}
STEPS, SAVE_INTERVAL = 5, 2
# The Done-when bound (fp32). Measured largest loss difference between expert-parallel 2 and 1
# over 5 steps, seeds 0-3 at ZeRO-0, 1 and 2: 4.8e-7 (0 in 8 of the 12 runs).
TOLERANCE = 1e-5
ZERO0 = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW"}}


def moe_run(tiny_data, out_dir, expert_parallel_size, **train):
    raw = tiny_run_config(tiny_data, out_dir, max_steps=STEPS, expert_parallel_size=expert_parallel_size, **train)
    raw["model"].update(MOE)
    return raw


def train_all(rank, world_size, runs, resumed, refused):
    """Each (run config, ds_config) of `runs` (with its weights gathered at the end); then each of
    `resumed` from its checkpoint; then the messages refusing each of `refused` (run config and
    ds_config, checkpoint)."""
    from llmstack.errors import UserError
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    weights = {}
    for raw, ds_config in runs:
        trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config)
        trainer.train()
        weights[raw["train"]["out_dir"]] = trainer.model.full_state_dict()
    for (raw, ds_config), checkpoint in resumed:
        trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config)
        trainer.resume(checkpoint)
        trainer.train()
    messages = []
    for (raw, ds_config), checkpoint in refused:
        try:
            Trainer(parse_run_config(raw), ds_config_path=ds_config).resume(checkpoint)
        except UserError as e:
            messages.append(str(e))
    return weights, messages


def records(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def losses(out_dir):
    return {r["step"]: r["loss"] for r in records(out_dir)}


def test_expert_parallel_trainer_matches_ep1_resumes_exactly_and_exports_one_mixtral(tmp_path, tiny_data):
    (tmp_path / "zero0.json").write_text(json.dumps(ZERO0))
    stages = {"zero0": (str(tmp_path / "zero0.json"), {"grad_clip": 0.0}), "zero2": ("ds_configs/zero2.json", {})}
    saving = {"save_interval": SAVE_INTERVAL, "keep_last": 0}
    runs = [
        (moe_run(tiny_data, tmp_path / f"{stage}_ep{ep}", ep, **train, **saving), ds_config)
        for stage, (ds_config, train) in stages.items()
        for ep in (1, 2)
    ]
    zero2 = stages["zero2"][0]
    step2 = {stage: str(tmp_path / f"{stage}_ep2" / "checkpoints" / f"global_step{SAVE_INTERVAL}") for stage in stages}
    resumed = [
        ((moe_run(tiny_data, tmp_path / f"{stage}_resumed", 2, **train), ds_config), step2[stage])
        for stage, (ds_config, train) in stages.items()
    ]
    refused = (moe_run(tiny_data, tmp_path / "refused", 1), zero2), step2["zero2"]
    too_many = (moe_run(tiny_data, tmp_path / "too_many", 4), zero2), step2["zero2"]
    refusals = [refused, too_many]
    weights, (resume_message, size_message) = run_distributed(train_all, 2, args=(runs, resumed, refusals))[0]

    for stage in stages:
        reference, split = losses(tmp_path / f"{stage}_ep1"), losses(tmp_path / f"{stage}_ep2")
        assert len(reference) == len(split) == STEPS
        assert max(abs(reference[s] - split[s]) for s in reference) <= TOLERANCE
    # The interrupted runs, resumed at step 2, continue exactly as the uninterrupted ones.
    for stage in stages:
        uninterrupted, continued = losses(tmp_path / f"{stage}_ep2"), losses(tmp_path / f"{stage}_resumed")
        assert sorted(continued) == list(range(SAVE_INTERVAL + 1, STEPS + 1))
        assert all(continued[s] == uninterrupted[s] for s in continued)
    assert "train.expert_parallel_size 2" in resume_message and "train.expert_parallel_size 1" in resume_message
    assert "train.expert_parallel_size (4) must divide the data-parallel size (2)" in size_message

    # Every step's all-to-alls (2 MoE layers; per rank, the mean over the ranks): dropless routing
    # sends each of the 4 x 32 tokens' 2 assignments, and the ranks receive what they send.
    rows = 4 * 32 * MOE["num_experts_per_tok"]
    expected = 2 * all_to_all_bytes(MOE["num_local_experts"], rows, rows, hidden=32, itemsize=4)
    assert [r["comm/all_to_all_bytes"] for r in records(tmp_path / "zero2_ep2")] == [expected] * STEPS
    assert "comm/all_to_all_bytes" not in records(tmp_path / "zero2_ep1")[0]

    ids = torch.randint(0, 256, (2, 16))
    for stage in stages:
        checkpoint = tmp_path / f"{stage}_ep2" / "checkpoints" / f"global_step{STEPS}"
        assert sorted(p.name for p in checkpoint.glob("experts_*")) == ["experts_ep_rank0.pt", "experts_ep_rank1.pt"]
        assert main(["export-hf", str(checkpoint), str(tmp_path / f"{stage}_mixtral"), "--format", "mixtral"]) == 0
        mixtral = MixtralForCausalLM.from_pretrained(tmp_path / f"{stage}_mixtral").eval()
        trained = LLMStackForCausalLM(LLMStackConfig.from_pretrained(tmp_path / f"{stage}_ep2" / "checkpoints"))
        trained.load_state_dict(weights[str(tmp_path / f"{stage}_ep2")])  # gathered from both ranks in memory
        with torch.no_grad():
            assert (mixtral(ids).logits - trained.eval()(ids).logits).abs().max() <= TOLERANCE
