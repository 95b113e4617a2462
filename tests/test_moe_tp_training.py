"""A mixture-of-experts model with tensor parallelism through the trainer (gloo, fp32, ZeRO-2):
tensor-parallel 2 x data-parallel 2 on 4 ranks, with and without expert parallelism 2, trains as
the same model on data-parallel 2 alone (2 ranks); its checkpoints resume exactly, a tensor-only
one also on tensor-parallel 1, one with split experts refuses another tensor-parallel size, and
both export to one stock Mixtral model. Their gradient norms (what clipping divides by) equal the
data-parallel run's: with split experts, each tensor-parallel rank's experts stay marked as its own
(before, only tensor-parallel rank 0's were counted: 1.19435 against 1.19482 at step 1)."""

import torch
from conftest import tiny_run_config
from test_moe_ep_training import losses, records
from transformers import MixtralForCausalLM

from llmstack.cli.main import main
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.testing import run_distributed

MOE = {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "router_z_loss_coef": 0.001}
STEPS, SAVED_AT = 5, 2
# The bound for parallel layouts (fp32). Measured over seeds 0-3, largest loss difference
# from the data-parallel run over 5 steps: tensor-parallel 2: 2.4e-7, x expert-parallel 2: 7.2e-7,
# resumed on tensor-parallel 1: 2.4e-7. The final weights drift further apart (Adam amplifies
# reduction-order rounding; exported logits differed from the data-parallel run's by up to 1.1e-5),
# so the export is checked against the run's own weights gathered in memory: measured 0 difference.
TOLERANCE = 1e-5


def moe_run(tiny_data, out_dir, tensor=1, expert=1, model=MOE, **train):
    """A run of `model` (MOE's fields over the tiny model's) for STEPS steps, saved at SAVED_AT."""
    raw = tiny_run_config(
        tiny_data,
        out_dir,
        max_steps=STEPS,
        save_interval=SAVED_AT,
        keep_last=0,
        tensor_parallel_size=tensor,
        expert_parallel_size=expert,
        **{"ds_config": "ds_configs/zero2.json", **train},
    )
    raw["model"].update(model)
    return raw


def train_runs(rank, world_size, runs, refused):
    """Each (run config, checkpoint to resume or None) of `runs`, returning each run's final weights
    gathered into one model; then the message refusing `refused` (None: no such case)."""
    from llmstack.errors import UserError
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    weights = {}
    for raw, checkpoint in runs:
        trainer = Trainer(parse_run_config(raw))
        if checkpoint is not None:
            trainer.resume(str(checkpoint))
        trainer.train()
        weights[raw["train"]["out_dir"]] = trainer.model.full_state_dict()
    if refused is None:
        return weights, None
    raw, checkpoint = refused
    try:
        Trainer(parse_run_config(raw)).resume(str(checkpoint))
    except UserError as e:
        return weights, str(e)
    return weights, None


def test_tensor_parallel_moe_trains_as_data_parallel_resumes_and_exports_one_mixtral(tmp_path, tiny_data):
    def run(name, **layout):
        return moe_run(tiny_data, tmp_path / name, **layout)

    def saved(name, step=SAVED_AT):
        return tmp_path / name / "checkpoints" / f"global_step{step}"

    four_ranks = [
        (run("tp2", tensor=2), None),
        (run("tp2_ep2", tensor=2, expert=2), None),
        (run("tp2_ep2_resumed", tensor=2, expert=2), saved("tp2_ep2")),
    ]
    refused = run("refused", expert=2), saved("tp2_ep2")  # tensor-parallel 1, data-parallel 4
    weights, message = run_distributed(train_runs, 4, args=(four_ranks, refused))[0]
    two_ranks = [(run("dp2"), None), (run("tp2_on_tp1"), saved("tp2"))]
    run_distributed(train_runs, 2, args=(two_ranks, None))

    reference = losses(tmp_path / "dp2")
    assert len(reference) == STEPS
    assert max(r["grad_norm"] for r in records(tmp_path / "dp2")) > 1.0  # clipping (at 1.0) acts
    for name in ("tp2", "tp2_ep2"):
        assert loss_difference(tmp_path / name, reference) <= TOLERANCE
        # The clipping norm counts every expert once: each tensor-parallel rank's, split or not.
        norms = [(r["grad_norm"], d["grad_norm"]) for r, d in zip(records(tmp_path / name), records(tmp_path / "dp2"))]
        assert max(abs(a - b) for a, b in norms) <= TOLERANCE, norms
    # Resumed at step 2: exactly the uninterrupted run on the same layout; on tensor-parallel 1,
    # the data-parallel run's losses.
    assert loss_difference(tmp_path / "tp2_ep2_resumed", losses(tmp_path / "tp2_ep2"), SAVED_AT) == 0
    assert loss_difference(tmp_path / "tp2_on_tp1", reference, SAVED_AT) <= TOLERANCE
    assert "tensor-parallel size 2" in message and "tensor-parallel size 1" in message

    assert sorted(p.name for p in saved("tp2_ep2", STEPS).glob("experts_*")) == [
        f"experts_tp_rank{t}_ep_rank{e}.pt" for t in range(2) for e in range(2)
    ]
    # The export is the model each run trained, gathered from its ranks in memory.
    for name in ("tp2", "tp2_ep2"):
        assert mixtral_export_error(tmp_path / name, saved(name, STEPS), weights) <= TOLERANCE


def loss_difference(run_dir, reference, resumed_at=0):
    """Largest difference of the run's logged losses from `reference` {step: loss}; the run logs
    every step after `resumed_at`."""
    logged = losses(run_dir)
    assert sorted(logged) == list(range(resumed_at + 1, STEPS + 1))
    return max(abs(loss - reference[step]) for step, loss in logged.items())


def mixtral_export_error(run_dir, checkpoint, weights):
    """Largest logit difference between `export-hf --format mixtral` of `checkpoint` and the run's
    own weights (`weights[str(run_dir)]`, gathered in memory)."""
    exported = run_dir.parent / f"{run_dir.name}_mixtral"
    assert main(["export-hf", str(checkpoint), str(exported), "--format", "mixtral"]) == 0
    mixtral = MixtralForCausalLM.from_pretrained(exported).eval()
    trained = LLMStackForCausalLM(LLMStackConfig.from_pretrained(run_dir / "checkpoints"))
    trained.load_state_dict(weights[str(run_dir)])
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        return (mixtral(ids).logits - trained.eval()(ids).logits).abs().max()
