"""Expert parallelism x pipeline parallelism through the trainer (4 gloo ranks: pipeline 2 x data
2 per stage, the experts of each stage split over its 2 data-parallel ranks; fp32, ZeRO-1,
clipping active): trains as the same model on one process with the same global batch and
forward-pass micro-batches; its checkpoint (one expert file per stage and expert-parallel rank)
resumes exactly, refuses another layout, and exports to one stock Mixtral model equal to the
run's weights gathered in memory.

Largest loss difference from the one-process run over 6 steps, seeds 0-3: 2.4e-7, 4.8e-7, 3.6e-7,
3.6e-7 (bound 1e-5). 50-75 s on 2 (shared) cores."""

import pytest
from conftest import tiny_run_config
from test_moe_ep_training import losses, records
from test_moe_pipeline_training import MOE
from test_moe_tp_training import mixtral_export_error, train_runs

from llmstack.testing import run_distributed

STEPS, SAVED_AT = 6, 2
TOLERANCE = 1e-5


def moe_run(tiny_data, out_dir, **train):
    """STEPS steps of 8 samples (micro-batches of 2), saved at SAVED_AT and at the end."""
    raw = tiny_run_config(
        tiny_data,
        out_dir,
        max_steps=STEPS,
        micro_batch_size=2,
        save_interval=SAVED_AT,
        keep_last=0,
        ds_config="ds_configs/zero1.json",
        **train,
    )
    raw["model"].update(MOE)
    return raw


def test_expert_x_pipeline_trains_as_one_process_resumes_and_exports_one_mixtral(tmp_path, tiny_data):
    def run(name, **train):
        return moe_run(tiny_data, tmp_path / name, **train)

    def saved(name, step=SAVED_AT):
        return tmp_path / name / "checkpoints" / f"global_step{step}"

    split = {"pipeline_parallel_size": 2, "expert_parallel_size": 2, "grad_accum_steps": 2}
    run_distributed(train_runs, 1, args=([(run("one", grad_accum_steps=4), None)], None))
    four_ranks = [(run("pp2_ep2", **split), None), (run("pp2_ep2_resumed", **split), saved("pp2_ep2"))]
    refused = run("refused", expert_parallel_size=2), saved("pp2_ep2")  # pipeline 1, data 4
    weights, message = run_distributed(train_runs, 4, args=(four_ranks, refused))[0]

    reference = losses(tmp_path / "one")
    assert len(reference) == STEPS
    assert max(r["grad_norm"] for r in records(tmp_path / "one")) > 1.0  # clipping (at 1.0) acts
    trained = losses(tmp_path / "pp2_ep2")
    assert sorted(trained) == sorted(reference)
    assert max(abs(trained[s] - reference[s]) for s in reference) <= TOLERANCE
    resumed = losses(tmp_path / "pp2_ep2_resumed")
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    assert all(resumed[s] == trained[s] for s in resumed)
    assert "pipeline-parallel size 2" in message and "pipeline-parallel size 1" in message

    # Routing metrics from both stages' layers.
    for record in records(tmp_path / "pp2_ep2"):
        for layer in range(MOE["num_hidden_layers"]):
            assert sum(record[f"moe/load/layer{layer}/expert{e}"] for e in range(4)) == pytest.approx(1.0)

    assert sorted(p.name for p in saved("pp2_ep2", STEPS).glob("experts_*")) == [
        f"experts_pp_rank{p}_ep_rank{e}.pt" for p in range(2) for e in range(2)
    ]
    assert mixtral_export_error(tmp_path / "pp2_ep2", saved("pp2_ep2", STEPS), weights) <= TOLERANCE
