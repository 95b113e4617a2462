"""A mixture-of-experts model with pipeline parallelism through the trainer (gloo, fp32, ZeRO-1,
2 micro-batches a step): pipeline 2, with and without activation checkpointing, and pipeline 2 x
tensor 2 train as the same model on one rank, the router losses carried from stage to stage; a
pipeline checkpoint resumes exactly, resumes on one rank too, and exports to a stock Mixtral
model; the routing metrics cover every stage's layers (expert parallelism with a pipeline:
tests/test_moe_ep_pipeline.py)."""

import pytest
from test_moe_ep_training import losses, records
from test_moe_tp_training import SAVED_AT, STEPS, loss_difference, mixtral_export_error, train_runs
from test_moe_tp_training import moe_run as tp_moe_run

from llmstack.testing import run_distributed

MOE = {
    "num_hidden_layers": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "router_aux_loss_coef": 0.05,
    "router_z_loss_coef": 0.01,
}
# The bound for parallel layouts (fp32). Largest loss difference from the one-rank run over 5 steps,
# seeds 0-3: 7.2e-7 (pipeline 2, with or without activation checkpointing), 4.8e-7 (pipeline 2 x
# tensor 2). Without the router losses' gradient crossing stages it is 1e-2.
TOLERANCE = 1e-5


def moe_run(tiny_data, out_dir, pipeline=1, **layout):
    return tp_moe_run(
        tiny_data,
        out_dir,
        model=MOE,
        pipeline_parallel_size=pipeline,
        grad_accum_steps=2,
        ds_config="ds_configs/zero1.json",
        **layout,
    )


def test_pipeline_moe_trains_as_one_rank_resumes_and_exports_one_mixtral(tmp_path, tiny_data):
    def run(name, **layout):
        return moe_run(tiny_data, tmp_path / name, **layout)

    def saved(name, step=SAVED_AT):
        return tmp_path / name / "checkpoints" / f"global_step{step}"

    run_distributed(train_runs, 1, args=([(run("one_rank"), None)], None))
    two_ranks = [
        (run("pp2", pipeline=2), None),
        (run("pp2_checkpointed", pipeline=2, activation_checkpointing=True), None),
        (run("pp2_resumed", pipeline=2), saved("pp2")),
    ]
    weights, _ = run_distributed(train_runs, 2, args=(two_ranks, None))[0]
    four_ranks = [(run("pp2_tp2", pipeline=2, tensor=2), None)]
    more_weights, _ = run_distributed(train_runs, 4, args=(four_ranks, None))[0]
    weights.update(more_weights)
    run_distributed(train_runs, 1, args=([(run("pp2_on_one_rank"), saved("pp2"))], None))

    reference = losses(tmp_path / "one_rank")
    assert len(reference) == STEPS
    for name in ("pp2", "pp2_checkpointed", "pp2_tp2"):
        assert loss_difference(tmp_path / name, reference) <= TOLERANCE
    assert loss_difference(tmp_path / "pp2_resumed", losses(tmp_path / "pp2"), SAVED_AT) == 0
    assert loss_difference(tmp_path / "pp2_on_one_rank", reference, SAVED_AT) <= TOLERANCE

    # Routing metrics from both stages: each layer's load is a distribution over the experts.
    for record in records(tmp_path / "pp2"):
        for layer in range(MOE["num_hidden_layers"]):
            load = [record[f"moe/load/layer{layer}/expert{e}"] for e in range(4)]
            assert sum(load) == pytest.approx(1.0)
        assert 1.9 < record["moe/aux_loss"] < 4 and record["moe/z_loss"] > 0

    for name in ("pp2", "pp2_tp2"):
        assert mixtral_export_error(tmp_path / name, saved(name, STEPS), weights) <= TOLERANCE
