"""Resuming across context-parallel sizes (2 -> 1 and 1 -> 2), three launches.

Every run has the same seed, the same global batch of 8 samples of 32 tokens and ZeRO-1. A run
saves at step 3 on layout A and resumes on layout B; its losses at steps 4-6 must equal those of a
run on layout B that was never interrupted. Each rank records the global sample numbers it reads:
a context-parallel group reads the samples that one data-parallel rank would (both of its ranks
the same ones), so every run reads samples 8(s-1) ... 8s-1 at step s, and a resumed run goes on
from sample 24, as data parallelism alone does.

A streaming mixture (data.sources) continues only on the data-parallel size that saved it, a
context-parallel group counting as one data-parallel rank: context 2 -> 1 rank continues, context
2 -> data 2 is refused.
"""

import json
import os

import pytest
from conftest import tiny_run_config
from test_checkpoint_runs import stream_config, write_sources

from llmstack.testing import run_distributed

SAVED_AT, STEPS, GLOBAL_BATCH = 3, 6, 8
# Largest difference between a resumed run's loss (about 5) and the uninterrupted run's, over
# train.seed 1234, 1 and 2: 2.4e-7 (1 or 2 float32 ulps at one step; 0 at most steps): context 2
# -> 1 rank 2.4e-7, 1 rank -> context 2 1.2e-7, data 2 -> context 2 1.2e-7, context 2 -> data 2 0,
# the stream context 2 -> 1 rank 2.4e-7.
TOLERANCE = 1e-6


def layout_config(data, out_dir, data_parallel=1, context=1):
    raw = tiny_run_config(
        data,
        out_dir,
        max_steps=STEPS,
        save_interval=SAVED_AT,
        micro_batch_size=4,
        grad_accum_steps=2 // data_parallel,
        context_parallel_size=context,
    )
    raw["data"]["prefetch"] = 0  # the samples read are those trained on, none read ahead
    return raw


def train(raw, resume_from=None):
    """{"resumed_at": (step, consumed samples), "losses": {step: loss}, "samples": the global sample
    numbers this rank read, in order}."""
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    trainer = Trainer(parse_run_config(raw), ds_config_path="ds_configs/zero1.json")
    samples = []
    if hasattr(trainer.train_data, "sample"):  # packed blocks; a stream has no sample numbers
        read = trainer.train_data.sample

        def recorded(i):
            samples.append(i)
            return read(i)

        trainer.train_data.sample = recorded
    if resume_from is not None:
        trainer.resume(str(resume_from))
    resumed_at = (trainer.step, trainer.consumed_samples)
    trainer.train()
    with open(os.path.join(raw["train"]["out_dir"], "metrics.jsonl")) as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    return {"resumed_at": resumed_at, "losses": losses, "samples": samples, "layout": trainer.layout.describe()}


def checkpoint(base, name):
    return base / name / "checkpoints" / f"global_step{SAVED_AT}"


def streamed(data, base, name, data_parallel=1, context=1):
    return stream_config(
        data,
        base,
        base / name,
        max_steps=STEPS,
        save_interval=SAVED_AT,
        grad_accum_steps=2 // data_parallel,
        context_parallel_size=context,
    )


def two_ranks_first(rank, world_size, base, data):
    return {
        "data2": train(layout_config(data, base / "data2", data_parallel=2)),
        "context2": train(layout_config(data, base / "context2", context=2)),
        "stream_context2": train(streamed(data, base, "stream_context2", context=2)),
    }


def one_rank(rank, world_size, base, data):
    return {
        "plain": train(layout_config(data, base / "plain")),
        "context2_to_plain": train(layout_config(data, base / "context2_to_plain"), checkpoint(base, "context2")),
        "stream_plain": train(streamed(data, base, "stream_plain")),
        "stream_context2_to_plain": train(
            streamed(data, base, "stream_context2_to_plain"), checkpoint(base, "stream_context2")
        ),
    }


def two_ranks_again(rank, world_size, base, data):
    def resumed(source, name, **sizes):
        return train(layout_config(data, base / name, **sizes), checkpoint(base, source))

    return {
        "plain_to_context2": resumed("plain", "plain_to_context2", context=2),
        "data2_to_context2": resumed("data2", "data2_to_context2", context=2),
        "context2_to_data2": resumed("context2", "context2_to_data2", data_parallel=2),
        "stream_context2_to_data2": stream_refused(base, data),
    }


def stream_refused(base, data):
    """The context-parallel stream's checkpoint (1 data-parallel rank) on 2 data-parallel ranks."""
    from llmstack.errors import UserError
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    raw = streamed(data, base, "stream_context2_to_data2", data_parallel=2)
    trainer = Trainer(parse_run_config(raw), ds_config_path="ds_configs/zero1.json")
    try:
        trainer.resume(str(checkpoint(base, "stream_context2")))
    except UserError as e:
        return {"message": str(e), "step": trainer.step}
    return {"message": None}


def by_rank(results):
    """{run name: [rank 0's result, rank 1's, ...]} from run_distributed's per-rank dicts."""
    return {name: [rank_results[name] for rank_results in results] for name in results[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("resume_context")
    write_sources(base)
    results = by_rank(run_distributed(two_ranks_first, 2, args=(base, tiny_data)))
    results.update(by_rank(run_distributed(one_rank, 1, args=(base, tiny_data))))
    results.update(by_rank(run_distributed(two_ranks_again, 2, args=(base, tiny_data))))
    return results


@pytest.mark.parametrize(
    ("resumed", "uninterrupted"),
    [
        ("context2_to_plain", "plain"),
        ("plain_to_context2", "context2"),
        ("data2_to_context2", "context2"),
        ("context2_to_data2", "data2"),
        ("stream_context2_to_plain", "stream_plain"),
    ],
)
def test_resume_across_context_parallel_sizes_continues_the_uninterrupted_run(runs, resumed, uninterrupted):
    reference = runs[uninterrupted][0]["losses"]
    for rank_result in runs[resumed]:
        assert rank_result["resumed_at"] == (SAVED_AT, SAVED_AT * GLOBAL_BATCH)
    result = runs[resumed][0]["losses"]
    assert sorted(result) == [4, 5, 6]
    for step, loss in result.items():
        assert abs(loss - reference[step]) <= TOLERANCE, (step, loss, reference[step])


def samples_per_step(rank_results, context):
    """[the sorted global sample numbers of each step, over the data-parallel ranks]; the ranks of
    a context-parallel group read the same samples, so one of them stands for it."""
    for group_start in range(0, len(rank_results), context):
        group = rank_results[group_start : group_start + context]
        assert all(r["samples"] == group[0]["samples"] for r in group), "a context group read different samples"
    readers = [r["samples"] for r in rank_results[::context]]
    per_rank = GLOBAL_BATCH // len(readers)
    steps = len(readers[0]) // per_rank
    return [sorted(i for r in readers for i in r[s * per_rank : (s + 1) * per_rank]) for s in range(steps)]


@pytest.mark.parametrize(
    ("name", "context", "first_step"),
    [
        ("plain", 1, 1),
        ("data2", 1, 1),
        ("context2", 2, 1),
        ("context2_to_plain", 1, SAVED_AT + 1),
        ("plain_to_context2", 2, SAVED_AT + 1),
        ("data2_to_context2", 2, SAVED_AT + 1),
        ("context2_to_data2", 1, SAVED_AT + 1),
    ],
)
def test_context_parallel_runs_read_the_samples_of_data_parallelism(runs, name, context, first_step):
    if context > 1:
        assert "context 2" in runs[name][0]["layout"]
    expected = [list(range((s - 1) * GLOBAL_BATCH, s * GLOBAL_BATCH)) for s in range(first_step, STEPS + 1)]
    assert samples_per_step(runs[name], context) == expected


def test_a_context_parallel_stream_is_refused_on_another_data_parallel_size(runs):
    for refused in runs["stream_context2_to_data2"]:
        assert "saved by 1 data-parallel ranks" in refused["message"], refused["message"]
        assert refused["step"] == 0
