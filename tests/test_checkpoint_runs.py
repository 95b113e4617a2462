"""Checkpoints in real training runs on CPU, three launches in all.

2 ranks: exact resume (dropout on, async saves, retention), reference runs for ZeRO-1/2/3,
SIGTERM on one rank, a write error on one rank (fatal, then retried), a damaged newest checkpoint,
exact resume of a streaming mixture (data.sources). 1 rank: elastic resume 2 -> 1 for ZeRO-2 and
ZeRO-3, non-finite losses, a loss spike, an untrusted checkpoint, wall-clock saves, the 2-rank
stream refused. 2 ranks again: elastic resume 1 -> 2. Export is checked against DeepSpeed's
zero_to_fp32 on the reference checkpoints.
"""

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import signal

import pytest
import torch
from conftest import tiny_run_config

from llmstack.testing import run_distributed

STAGES = ("zero2", "zero3")


def run_config(data, out_dir, dropout=0.0, **train):
    raw = tiny_run_config(data, out_dir, **train)
    raw["model"].update(hidden_dropout=dropout, attention_dropout=dropout)
    return raw


def make_trainer(raw, ds="zero2"):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    return Trainer(parse_run_config(raw), ds_config_path=f"ds_configs/{ds}.json")


def stream_config(data, base, out_dir, **train):
    """A run fed by a streaming mixture of the raw documents under base/sources (see write_sources)."""
    raw = run_config(data, out_dir, **train)
    sources = [
        {"paths": str(base / "sources" / f"{name}-*.jsonl"), "weight": weight}
        for name, weight in (("prose", 0.7), ("lists", 0.3))
    ]
    raw["data"] = {"tokenizer": data["tokenizer"], "sources": sources, "seq_len": 32}
    return raw


def write_sources(base):
    """Two sources of 2 files each (a multiple of the 2 data-parallel ranks), 40 documents per file."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()
    (base / "sources").mkdir()
    for name, sep in (("prose", " "), ("lists", ", ")):
        for f in range(2):
            with open(base / "sources" / f"{name}-{f}.jsonl", "w") as out:
                for d in range(40):
                    text = sep.join(words[(d * 5 + j * 3 + f) % len(words)] for j in range(10 + d % 25))
                    out.write(json.dumps({"text": text}) + "\n")


def logged_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def entries(directory):
    return sorted(os.listdir(directory))


def on_training_forward(trainer, action):
    """Call action(step being computed, final hidden states) on every training forward; it may
    replace the hidden states. (Training computes the loss from them without calling lm_head, and
    the head is linear: hidden x 50 is logits x 50, NaN hidden states NaN logits.)"""

    def hook(module, inputs, output):
        return action(trainer.step + 1, output) if module.training else None

    return trainer.engine.module.model.norm.register_forward_hook(hook)


class Messages(logging.Handler):
    """Collects the warnings of the checkpoint and fault modules; calls `on_message` on each."""

    def __init__(self, on_message=None):
        super().__init__()
        self.messages, self.on_message = [], on_message

    def emit(self, record):
        self.messages.append(record.getMessage())
        if self.on_message:
            self.on_message(record.getMessage())

    @contextlib.contextmanager
    def listening(self):
        loggers = [
            logging.getLogger(name)
            for name in ("llmstack.training.checkpoint", "llmstack.training.faults", "llmstack.data.stream")
        ]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeHandler(self)


# Above DeepSpeed's recovery scripts (copied to the checkpoint root at every save), below the shards.
LIMIT = 60_000


def file_size_limit(limit):
    """Writes past `limit` bytes fail with EFBIG (a full disk, as far as the writer can tell)."""
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


def limit_writes_from_step_3(step, hidden):
    if step == 3:
        file_size_limit(LIMIT)


def no_file_size_limit():
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def max_weight_difference(trainer, reference):
    """Largest |weight - reference| over the engine's (possibly ZeRO-3-partitioned) parameters."""
    import deepspeed

    worst = 0.0
    for name, p in trainer.engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else contextlib.nullcontext():
            worst = max(worst, (p.detach().float() - reference[name]).abs().max().item())
    return worst


# ---- launch 1: two ranks


def exact_resume(base, data):
    raw = run_config(
        data, base / "exact", dropout=0.1, max_steps=6, save_interval=2, async_save=True, keep_last=1, keep_every=4
    )
    make_trainer(raw).train()
    trainer = make_trainer(run_config(data, base / "exact_resumed", dropout=0.1, max_steps=6, save_interval=2))
    trainer.resume(str(base / "exact" / "checkpoints" / "global_step4"))
    resumed_at = (trainer.step, trainer.consumed_samples)
    trainer.train()
    return {
        "losses": logged_losses(base / "exact"),
        "resumed_losses": logged_losses(base / "exact_resumed"),
        "resumed_at": resumed_at,
        "checkpoints": entries(base / "exact" / "checkpoints"),
    }


def sigterm_on_rank_1(base, data, rank):
    trainer = make_trainer(run_config(data, base / "sigterm", max_steps=50, save_interval=100))
    previous_handler = signal.getsignal(signal.SIGTERM)

    def preempt(step, hidden):
        if rank == 1 and step == 3 and trainer.guard.signal is None:
            os.kill(os.getpid(), signal.SIGTERM)

    on_training_forward(trainer, preempt)
    trainer.train()
    return {
        "stopped_by": trainer.stopped_by,
        "step": trainer.step,
        "checkpoints": entries(base / "sigterm" / "checkpoints"),
        "handler_restored": signal.getsignal(signal.SIGTERM) is previous_handler,
    }


def write_error_on_rank_1(base, data, rank):
    from llmstack.training.checkpoint.manager import CheckpointSaveError

    trainer = make_trainer(run_config(data, base / "write_error", max_steps=6, save_interval=2))
    on_training_forward(trainer, limit_writes_from_step_3 if rank == 1 else lambda step, hidden: None)
    error = None
    try:
        trainer.train()
    except CheckpointSaveError as e:
        error = str(e)
    finally:
        no_file_size_limit()
    after_error = entries(base / "write_error" / "checkpoints")
    resumed = make_trainer(run_config(data, base / "write_error", max_steps=6, save_interval=2))
    resumed.resume("auto")
    return {"error": error, "after_error": after_error, "resumed_step": resumed.step}


def write_error_retried(base, data, rank):
    trainer = make_trainer(
        run_config(data, base / "retry", max_steps=4, save_interval=2, save_retries=1, save_retry_wait_s=0)
    )
    on_training_forward(trainer, limit_writes_from_step_3 if rank == 0 else lambda step, hidden: None)
    lift_on_retry = Messages(lambda message: "retrying" in message and no_file_size_limit())
    with lift_on_retry.listening():
        trainer.train()
    no_file_size_limit()
    return {"messages": lift_on_retry.messages, "checkpoints": entries(base / "retry" / "checkpoints")}


def damaged_newest(base, data, rank):
    """ref_zero2 saved steps 2, 4, 6, 8: in a copy, corrupt 8 and remove a shard of 6."""
    damaged = base / "damaged"
    if rank == 0:
        shutil.copytree(base / "ref_zero2" / "checkpoints", damaged)
        shard = damaged / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.remove(damaged / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.distributed.barrier()
    trainer = make_trainer(run_config(data, base / "fallback", max_steps=8))
    with Messages().listening() as warnings:
        trainer.resume(str(damaged))
    return {"step": trainer.step, "consumed": trainer.consumed_samples, "warnings": warnings.messages}


def stream_exact_resume(base, data):
    """A streaming mixture saved at step 3 (each rank's place in it) and resumed in a new trainer."""
    make_trainer(stream_config(data, base, base / "stream", max_steps=6, save_interval=3)).train()
    trainer = make_trainer(stream_config(data, base, base / "stream_resumed", max_steps=6))
    with Messages().listening() as warnings:
        trainer.resume(str(base / "stream" / "checkpoints" / "global_step3"))
        trainer.train()
    return {
        "losses": logged_losses(base / "stream"),
        "resumed_losses": logged_losses(base / "stream_resumed"),
        "warnings": warnings.messages,
        "checkpoint": entries(base / "stream" / "checkpoints" / "global_step3"),
    }


def two_rank_runs(rank, world_size, base, data):
    results = {"exact": exact_resume(base, data), "stream": stream_exact_resume(base, data)}
    for stage in STAGES:
        make_trainer(run_config(data, base / f"ref_{stage}", max_steps=8, save_interval=2, keep_last=0), stage).train()
    make_trainer(run_config(data, base / "ref_zero1", max_steps=6, save_interval=6), "zero1").train()
    results["sigterm"] = sigterm_on_rank_1(base, data, rank)
    results["write_error"] = write_error_on_rank_1(base, data, rank)
    results["retry"] = write_error_retried(base, data, rank)
    results["fallback"] = damaged_newest(base, data, rank)
    return results


# ---- launch 2: one rank


def resume_elastic(base, data, stage, source, out_name, accum):
    """Resume checkpoint `source` on this launch's ranks; global batch 8 whatever the rank count."""
    from llmstack.training.export import consolidated_state_dict

    trainer = make_trainer(
        run_config(data, base / out_name, max_steps=8, save_interval=2, keep_last=0, grad_accum_steps=accum), stage
    )
    trainer.resume(str(source))
    resumed_at = (trainer.step, trainer.consumed_samples)
    weight_difference = max_weight_difference(trainer, consolidated_state_dict(str(source.parent), source.name))
    trainer.train()
    return {
        "resumed_at": resumed_at,
        "weight_difference": weight_difference,
        "final": (trainer.step, trainer.consumed_samples),
        "losses": logged_losses(base / out_name),
    }


def nonfinite_losses(base, data):
    """NaN hidden states (so NaN logits) at step 2, then at 5, 6 and 7: stop after 3 skipped steps in a row."""
    from llmstack.errors import UserError

    trainer = make_trainer(run_config(data, base / "nan", max_steps=8, save_interval=100, max_nonfinite_steps=3))
    weights_before = {}

    def poison(step, hidden):
        weights_before.setdefault(step, trainer.engine.module.lm_head.weight.detach().clone())
        return hidden * math.nan if step in (2, 5, 6, 7) else None

    on_training_forward(trainer, poison)
    error = None
    try:
        trainer.train()
    except UserError as e:
        error = str(e)
    return {
        "error": error,
        "skipped": trainer.guard.counters["skipped_steps"],
        "step_1_applied": not torch.equal(weights_before[1], weights_before[2]),
        "step_2_skipped": torch.equal(weights_before[2], weights_before[3]),
        "losses": logged_losses(base / "nan"),
    }


def loss_spike(base, data):
    """Hidden states (so logits) x 50 once, at step 5: roll back to step 4, skip step 5's samples, go on to step 8."""
    trainer = make_trainer(
        run_config(data, base / "spike", max_steps=8, save_interval=2, loss_spike_factor=2.0, loss_spike_window=3)
    )
    spiked = []

    def spike(step, hidden):
        if step == 5 and not spiked:
            spiked.append(step)
            return hidden * 50
        return None

    on_training_forward(trainer, spike)
    with Messages().listening() as warnings:
        trainer.train()
    return {
        "counters": dict(trainer.guard.counters),
        "final": (trainer.step, trainer.consumed_samples),
        "engine_steps": trainer.engine.global_steps,
        "warnings": warnings.messages,
    }


def untrusted(base, data):
    from llmstack.errors import UserError

    foreign = base / "foreign" / "global_step4"
    shutil.copytree(base / "ref_zero2" / "checkpoints" / "global_step4", foreign)
    os.remove(foreign / "manifest.json")
    trainer = make_trainer(run_config(data, base / "untrusted", max_steps=8, grad_accum_steps=2))
    try:
        trainer.resume(str(foreign))
        refused = None
    except UserError as e:
        refused = str(e)
    trainer.resume(str(foreign), trust=True)
    corrupt = base / "corrupt" / "global_step4"
    shutil.copytree(base / "ref_zero2" / "checkpoints" / "global_step4", corrupt)
    (corrupt / "manifest.json").write_text('{"version": 2, "files": {')  # cut short
    try:
        trainer.resume(str(corrupt), trust=True)
        corrupt_refused = None
    except UserError as e:
        corrupt_refused = str(e)
    return {"refused": refused, "trusted_step": trainer.step, "corrupt_refused": corrupt_refused}


def wall_clock_saves(base, data):
    """save_interval_minutes alone (the step interval never comes): a save after every step."""
    trainer = make_trainer(
        run_config(data, base / "clock", max_steps=3, save_interval=100, save_interval_minutes=1e-6, keep_last=0)
    )
    trainer.train()
    return entries(base / "clock" / "checkpoints")


def stream_on_one_rank(base, data):
    """The 2-rank stream checkpoint on 1 rank: refused before anything is loaded."""
    from llmstack.errors import UserError

    trainer = make_trainer(stream_config(data, base, base / "stream_one_rank", max_steps=6, grad_accum_steps=2))
    try:
        trainer.resume(str(base / "stream" / "checkpoints" / "global_step3"))
        return {"refused": None}
    except UserError as e:
        return {"refused": str(e), "step": trainer.step, "engine_steps": trainer.engine.global_steps}


def one_rank_runs(rank, world_size, base, data):
    results = {
        stage: resume_elastic(
            base, data, stage, base / f"ref_{stage}" / "checkpoints" / "global_step4", f"down_{stage}", accum=2
        )
        for stage in STAGES
    }
    results["nan"] = nonfinite_losses(base, data)
    results["spike"] = loss_spike(base, data)
    results["untrusted"] = untrusted(base, data)
    results["clock"] = wall_clock_saves(base, data)
    results["stream"] = stream_on_one_rank(base, data)
    return results


# ---- launch 3: two ranks again


def two_rank_elastic_runs(rank, world_size, base, data):
    return {
        stage: resume_elastic(
            base, data, stage, base / f"down_{stage}" / "checkpoints" / "global_step6", f"up_{stage}", accum=1
        )
        for stage in STAGES
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("checkpoint_runs")
    write_sources(base)
    two = run_distributed(two_rank_runs, 2, args=(base, tiny_data))
    one = run_distributed(one_rank_runs, 1, args=(base, tiny_data))[0]
    up = run_distributed(two_rank_elastic_runs, 2, args=(base, tiny_data))[0]
    return {"base": base, "two": two[0], "two_rank_1": two[1], "one": one, "up": up}


def test_resume_continues_bit_for_bit_with_dropout_async_saves_and_retention(runs):
    exact = runs["two"]["exact"]
    assert exact["resumed_at"] == (4, 32)
    losses = exact["losses"]
    assert len(losses) == 6 and exact["resumed_losses"] == {5: losses[5], 6: losses[6]}
    # keep_last=1, keep_every=4: step 2 deleted; nothing half-written left behind.
    assert [e for e in exact["checkpoints"] if "step" in e] == ["global_step4", "global_step6"]


def test_stream_resumes_from_each_ranks_saved_place_bit_for_bit(runs):
    stream = runs["two"]["stream"]
    losses = stream["losses"]
    assert len(losses) == 6 and stream["resumed_losses"] == {s: losses[s] for s in (4, 5, 6)}
    assert {"data_rank0.json", "data_rank1.json"} <= set(stream["checkpoint"])
    assert not [w for w in stream["warnings"] if "replaying" in w]  # continued from the saved place


def test_stream_saved_on_two_ranks_is_refused_on_one_before_loading(runs):
    refused = runs["one"]["stream"]
    assert (
        "saved by 2 data-parallel ranks" in refused["refused"]
        and "Resume with 2 data-parallel ranks" in refused["refused"]
    )
    assert refused["step"] == 0 and refused["engine_steps"] == 0


def test_sigterm_on_one_rank_saves_on_all_and_stops(runs):
    for result in (runs["two"]["sigterm"], runs["two_rank_1"]["sigterm"]):
        assert result["stopped_by"] == signal.SIGTERM and result["step"] == 3 and result["handler_restored"]
        assert "global_step3" in result["checkpoints"]


def test_write_error_on_one_rank_fails_the_save_and_keeps_the_previous_checkpoint(runs):
    for result in (runs["two"]["write_error"], runs["two_rank_1"]["write_error"]):
        assert "could not save checkpoint global_step4: " in result["error"]
        assert (
            "File too large" in result["error"] and "the previous checkpoint global_step2 is intact" in result["error"]
        )
        assert [e for e in result["after_error"] if "step" in e] == ["global_step2"]
        assert result["resumed_step"] == 2
    with open(runs["base"] / "write_error" / "checkpoints" / "latest") as f:
        assert f.read() == "global_step2"


def test_a_retried_save_succeeds_once_the_disk_has_room(runs):
    retry = runs["two"]["retry"]
    assert any("saving global_step4 failed" in m and "retrying" in m for m in retry["messages"])
    assert [e for e in retry["checkpoints"] if "step" in e] == ["global_step2", "global_step4"]


def test_resume_skips_a_corrupt_and_an_incomplete_newest_checkpoint(runs):
    fallback = runs["two"]["fallback"]
    assert (fallback["step"], fallback["consumed"]) == (4, 32)
    warnings = " | ".join(fallback["warnings"])
    assert "global_step8: zero_pp_rank_1_mp_rank_00_optim_states.pt fails its checksum" in warnings
    assert "global_step6: zero_pp_rank_0_mp_rank_00_optim_states.pt is missing" in warnings
    assert "resuming from global_step4 instead" in warnings


@pytest.mark.parametrize("stage", STAGES)
def test_elastic_resume_two_to_one_and_one_to_two_ranks(runs, stage):
    reference = logged_losses(runs["base"] / f"ref_{stage}")  # 2 ranks, uninterrupted
    down, up = runs["one"][stage], runs["up"][stage]
    # Weights restored exactly; the sample count carries over and grows by the global batch (8).
    assert down["resumed_at"] == (4, 32) and down["weight_difference"] == 0.0 and down["final"] == (8, 64)
    assert up["resumed_at"] == (6, 48) and up["weight_difference"] == 0.0 and up["final"] == (8, 64)
    # Same samples, optimizer state and schedule: the losses are the uninterrupted run's, exactly
    # (2 ranks sum two gradients, 1 rank accumulates two halves: in fp32 both give (a + b) / 2).
    assert {s: down["losses"][s] for s in (5, 6, 7, 8)} == {s: reference[s] for s in (5, 6, 7, 8)}
    assert {s: up["losses"][s] for s in (7, 8)} == {s: down["losses"][s] for s in (7, 8)}


def test_saves_by_wall_clock_interval(runs):
    assert [e for e in runs["one"]["clock"] if "step" in e] == ["global_step1", "global_step2", "global_step3"]


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run_when_repeated(runs):
    nan = runs["one"]["nan"]
    assert nan["step_1_applied"] and nan["step_2_skipped"]
    assert "stopping at step 7: 3 steps in a row had a non-finite loss" in nan["error"]
    assert nan["skipped"] == 4
    assert all(math.isfinite(nan["losses"][s]) for s in (1, 3, 4)) and math.isnan(nan["losses"][2])


def test_loss_spike_rolls_back_and_skips_the_data_window(runs):
    spike = runs["one"]["spike"]
    # Rolled back from step 5 to 4, skipping step 5's 4 samples; DeepSpeed's own step count
    # came back with the checkpoint.
    assert spike["counters"] == {"skipped_steps": 0, "rollbacks": 1, "skipped_samples": 4}
    assert spike["final"] == (8, 36) and spike["engine_steps"] == 8
    assert any("step 5: loss" in w and "rolling back" in w for w in spike["warnings"])


def test_checkpoint_without_manifest_is_refused_unless_trusted_and_a_corrupt_one_always(runs):
    untrusted = runs["one"]["untrusted"]
    assert "no manifest.json" in untrusted["refused"] and "--trust-checkpoint" in untrusted["refused"]
    assert untrusted["trusted_step"] == 4
    assert "global_step4: manifest.json cannot be read" in untrusted["corrupt_refused"]
    assert "even with --trust-checkpoint" in untrusted["corrupt_refused"]


@pytest.mark.parametrize("stage", ("zero1", *STAGES))
def test_export_equals_deepspeed_zero_to_fp32(runs, stage, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from llmstack.safe_load import safe_loading
    from llmstack.training.export import export_hf

    root = str(runs["base"] / f"ref_{stage}" / "checkpoints")
    export_hf(os.path.join(root, "global_step6"), tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    with safe_loading():
        reference = get_fp32_state_dict_from_zero_checkpoint(root, "global_step6")
    assert set(exported) <= set(reference) and "model.embed_tokens.weight" in exported
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name
