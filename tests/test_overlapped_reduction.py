"""Gradient reduction overlapped with backward at ZeRO stage 0 (zero_optimization.overlap_comm):
buckets start while backward runs, and training is that of the reduction without overlap."""

import json
from pathlib import Path

import pytest
import torch

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.optim import initialize, overlapped_reduction
from llmstack.optim.deepspeed_integration import stage0_overlap_bucket
from llmstack.testing import run_distributed

SMALL_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
STEPS, ACCUMULATION, LR = 4, 2, 3e-3
BUCKET = 20_000  # elements: the small model's ~0.1M parameters in several buckets


def engine_for(overlap, method="none", fraction=0.01):
    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**SMALL_MODEL))
    zero = {"stage": 0, "overlap_comm": True, "reduce_bucket_size": BUCKET} if overlap else {"stage": 0}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
    }
    if method != "none":
        config["gradient_compression"] = {"method": method, "topk_fraction": fraction}
    if method == "topk":  # compressed from the first step (no dense warm-up)
        config["gradient_compression"]["warmup_steps"] = 0
    return initialize(model, config, model.parameters())[0]


def train(engine, rank):
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS * ACCUMULATION):
        ids = torch.randint(0, 64, (2, 32), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check_all(rank, world_size):
    results = {}
    for overlap, method, fraction in (
        (False, "none", 0.01),
        (True, "none", 0.01),
        (True, "topk", 1.0),
        (True, "int8", 0.01),
    ):
        engine = engine_for(overlap, method, fraction)
        reduction = overlapped_reduction(engine)
        started_when_backward_reached_the_embedding: list[int] = []
        if reduction is not None:
            engine.module.model.embed_tokens.register_full_backward_pre_hook(
                lambda *_, seen=started_when_backward_reached_the_embedding, r=reduction: seen.append(r.started)
            )
        results[overlap, method, fraction] = {
            "losses": train(engine, rank),
            "buckets": None if reduction is None else len(reduction.buckets),
            "started": started_when_backward_reached_the_embedding,
            "weights": torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]),
        }
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(check_all, world_size=2)


def test_overlapped_reduction_trains_exactly_as_the_engine_all_reduce(results):
    for rank in results:
        plain = rank[False, "none", 0.01]
        for key in ((True, "none", 0.01), (True, "topk", 1.0)):  # a full top-k sends every gradient
            assert rank[key]["losses"] == plain["losses"], key
            assert torch.equal(rank[key]["weights"], plain["weights"]), key
    assert torch.equal(results[0][True, "int8", 0.01]["weights"], results[1][True, "int8", 0.01]["weights"])
    # int8 per bucket: within 1% of uncompressed after 4 steps (measured 0.02% at seed 0)
    int8, plain = results[0][True, "int8", 0.01]["losses"], results[0][False, "none", 0.01]["losses"]
    assert sum(int8[-2:]) == pytest.approx(sum(plain[-2:]), rel=0.01)


def test_buckets_start_while_backward_still_runs(results):
    for rank in results:
        entry = rank[True, "none", 0.01]
        assert entry["buckets"] > 2
        # Only the accumulation step's last micro-batch reduces: its backward had started buckets
        # before reaching the embedding (the first layer, the last gradients), the others none.
        assert entry["started"][0::ACCUMULATION] == [0] * STEPS
        assert all(0 < n < entry["buckets"] for n in entry["started"][1::ACCUMULATION])


def test_overlap_reads_deepspeeds_keys_at_stage_0_only():
    assert stage0_overlap_bucket({"zero_optimization": {"stage": 0, "overlap_comm": True}}) == 25 * 2**20 // 4
    assert (
        stage0_overlap_bucket({"zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": 1e6}})
        == 10**6
    )
    assert stage0_overlap_bucket({"zero_optimization": {"stage": 2, "overlap_comm": True}}) is None  # DeepSpeed's own
    assert stage0_overlap_bucket({"zero_optimization": {"stage": 0}}) is None
    with pytest.raises(UserError, match="reduce_bucket_size"):
        stage0_overlap_bucket({"zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": 0}})


def test_the_layout_table_refuses_zero0_overlap_where_llmstack_does_not_reduce(tmp_path):
    from conftest import tiny_run_config

    from llmstack.parallel.layout import Layout, check_layout, refusals
    from llmstack.training.config import parse_run_config, run_layout

    check_layout(Layout(overlap_comm=True))
    check_layout(Layout(overlap_comm=True, zero_stage=2, precision="bf16"))  # DeepSpeed's own overlap_comm
    assert [rule.name for rule in refusals(Layout(overlap_comm=True, tensor=2, precision="bf16"))] == [
        "gradient compression or ZeRO-0 overlap with model parallelism",
        "gradient compression or ZeRO-0 overlap in bf16 or fp16",
    ]
    run = parse_run_config(tiny_run_config({"tokenizer": "tok", "train": ["data"]}, tmp_path))
    layout = run_layout(
        run, {"zero_optimization": {"stage": 0, "overlap_comm": True}, "optimizer": {"type": "OneBitAdam"}}
    )
    assert [rule.name for rule in refusals(layout)] == ["gradient compression or ZeRO-0 overlap with 1-bit Adam"]


def trainer_overlaps(rank, world_size, run):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    raw, ds_config = run
    return overlapped_reduction(Trainer(parse_run_config(raw), ds_config_path=ds_config).engine) is not None


def test_the_trainer_with_zero0_overlap_logs_the_plain_runs_losses(tmp_path, tiny_data):
    from conftest import tiny_run_config
    from test_moe_ep_training import losses, train_all

    overlap = json.loads(Path("ds_configs/zero0_overlap.json").read_text())
    overlap["zero_optimization"]["reduce_bucket_size"] = BUCKET
    plain = {**overlap, "zero_optimization": {"stage": 0}}
    runs = []
    for name, ds_config in (("plain", plain), ("overlap", overlap)):
        (tmp_path / f"{name}.json").write_text(json.dumps(ds_config))
        raw = tiny_run_config(tiny_data, tmp_path / name, max_steps=4, grad_accum_steps=2)
        runs.append((raw, str(tmp_path / f"{name}.json")))
    assert run_distributed(trainer_overlaps, 2, args=(runs[1],)) == [True, True]
    run_distributed(train_all, 2, args=(runs, [], []))
    assert losses(tmp_path / "overlap") == losses(tmp_path / "plain")
    assert len(losses(tmp_path / "plain")) == 4
