"""1-bit Adam at ZeRO stages 1 and 2 (the partitioned variant) and with split experts, on 2 ranks
(gloo) through the DeepSpeed engine: equality with ZeRO-0 in the warm-up and closeness after it,
bytes per step, bit-for-bit resume, and re-slicing the partitioned state for another world size."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.optim import OneBitAdam, initialize
from llmstack.optim.compressed_allreduce import allreduce_bytes, slice_layout
from llmstack.testing import run_distributed

FREEZE_STEP, STEPS, SAVE_AT = 3, 12, 6
MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def batches(rank, steps, batch=4, seq=32):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=g) for _ in range(steps)]


def engine(stage, seed=0):
    torch.manual_seed(seed)
    model = LLMStackForCausalLM(LLMStackConfig(**MODEL))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 3e-3, "weight_decay": 0.1, "freeze_step": FREEZE_STEP}},
        "steps_per_print": 10**9,
    }
    return initialize(model, config, model.parameters())[0]


def train(engine, data):
    losses, sent = [], []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        sent.append(engine.basic_optimizer.last_step_bytes)
    return losses, sent


def flat_weights(engine):
    return torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]).numpy().copy()


def check_stages(rank, world_size, save_dir):
    data = batches(rank, STEPS)
    results = {}
    for stage in (0, 1, 2):
        e = engine(stage)
        losses, sent = train(e, data[:SAVE_AT])
        if stage == 0:
            # The replicated state during the warm-up, to compare the partitioned state with.
            warmup = engine(0)
            train(warmup, data[:FREEZE_STEP])
            results["warmup_exp_avg"] = [
                warmup.basic_optimizer.state[p]["exp_avg"].numpy().copy() for p in warmup.module.parameters()
            ]
        if stage == 2:
            e.save_checkpoint(save_dir, tag="zero2")
        more = train(e, data[SAVE_AT:])
        results[stage] = {
            "losses": losses + more[0],
            "sent": sent + more[1],
            "weights": flat_weights(e),
            "partitioned": e.basic_optimizer.partition,
            "engine_stage": e.zero_optimization_stage(),
        }
    fresh = engine(2)
    fresh.load_checkpoint(save_dir, tag="zero2")
    results["resumed"] = train(fresh, data[SAVE_AT:])[0], flat_weights(fresh)
    results["numel"] = sum(p.numel() for p in fresh.module.parameters())
    # The state at the warm-up's end, gathered from both ranks (a collective), for the 1-rank re-slicing.
    partitioned = engine(2)
    train(partitioned, data[:FREEZE_STEP])
    state = partitioned.basic_optimizer.state_dict()
    results["state"] = {k: v.numpy() if torch.is_tensor(v) else v for k, v in state["state"]["onebit"].items()}
    results["shapes"] = [tuple(p.shape) for p in partitioned.module.parameters()]
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(check_stages, world_size=2, args=(str(tmp_path_factory.mktemp("onebit_zero")),))


def test_zero_1_and_2_run_partitioned_on_a_stage_0_engine(results):
    for r in results:
        assert [r[s]["partitioned"] for s in (0, 1, 2)] == [False, True, True]
        assert {r[s]["engine_stage"] for s in (0, 1, 2)} == {0}


def test_warmup_equals_zero_0_and_later_steps_stay_close(results):
    for r in results:
        zero0 = r[0]["losses"]
        for stage in (1, 2):
            losses = r[stage]["losses"]
            # The warm-up is AdamW on the same averaged gradients, computed slice by slice.
            assert losses[: FREEZE_STEP + 1] == zero0[: FREEZE_STEP + 1]
            # After it ZeRO-0 compresses the momentum, ZeRO-1/2 the gradient and the step: close,
            # not equal. Largest relative loss difference over the 9 later steps, measured for
            # model and data seeds 0-2 on both ranks: 0.30-0.73%; the bound leaves room.
            rel = np.abs(np.array(losses) - np.array(zero0)) / np.array(zero0)
            assert rel.max() < 0.02
        # ZeRO-1 and ZeRO-2 are the same computation.
        assert r[1]["losses"] == r[2]["losses"]
    np.testing.assert_array_equal(results[0][2]["weights"], results[1][2]["weights"])


def test_bytes_after_the_warmup_are_about_a_thirty_second_of_zero(results):
    for r in results:
        full = allreduce_bytes(r["numel"], 4, 2)
        sent = r[2]["sent"]
        # Warm-up: the fp32 gradient all-reduce plus the all-gather of this rank's updated slice.
        assert all(full * 1.5 <= s <= full * 1.5 * 1.05 for s in sent[:FREEZE_STEP])
        # After it: 1 bit per element each way plus a scale per tensor slice (ZeRO-0's count too).
        assert all(0 < s <= full / 20 for s in sent[FREEZE_STEP:])
        assert sent[FREEZE_STEP:] == r[0]["sent"][FREEZE_STEP:]


def test_resume_at_zero_2_is_bit_for_bit(results):
    for r in results:
        losses, weights = r["resumed"]
        assert losses == r[2]["losses"][SAVE_AT:]
        np.testing.assert_array_equal(weights, r[2]["weights"])


def test_partitioned_state_reslices_for_one_rank(results):
    """A 2-rank checkpoint's momentum and variance, loaded on 1 rank, are the whole tensors: at the
    warm-up's end they equal ZeRO-0's replicated momentum."""
    r = results[0]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in r["shapes"]]
    single = OneBitAdam(params, freeze_step=FREEZE_STEP, partition=True)
    saved = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in r["state"].items()}
    single.load_state_dict({"state": {"onebit": saved}, "param_groups": single.state_dict()["param_groups"]})
    rows = single.state["onebit"]["exp_avg"]
    assert rows.shape == (1, slice_layout(params, 1).width)
    whole = [torch.empty(s) for s in r["shapes"]]
    slice_layout(params, 1).scatter(rows, whole)
    # Equal up to rounding: torch's vectorized and scalar loops round lerp differently (fused
    # multiply-add), and a slice starts at another offset than the whole tensor (seen: 8e-10).
    for got, expected in zip(whole, r["warmup_exp_avg"]):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-8)
    assert single.state["onebit"]["step"] == FREEZE_STEP
    assert "worker_error" not in single.state["onebit"]  # none yet at the warm-up's end


def check_experts(rank, world_size, partition):
    """Dense parameters averaged over both ranks, "experts" (each rank its own) over a group of one."""
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    torch.manual_seed(0)
    dense = torch.nn.Linear(4, 4)
    torch.manual_seed(1 + rank)
    expert = torch.nn.Linear(4, 4)
    groups = [{"params": list(dense.parameters())}, {"params": list(expert.parameters()), "moe": True, "name": "ep"}]
    optimizer = OneBitAdam(groups, lr=1e-2, freeze_step=2, partition=partition, expert_group=alone)
    torch.manual_seed(1 + rank)
    reference = torch.nn.Linear(4, 4)  # the expert, alone, with half its gradient
    single = OneBitAdam(reference.parameters(), lr=1e-2, freeze_step=2, partition=partition, group=alone)
    for step in range(6):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        optimizer.zero_grad()
        single.zero_grad()
        (expert(dense(x)).square().mean()).backward()
        for p, q in zip(expert.parameters(), reference.parameters()):
            q.grad = p.grad / world_size
        optimizer.step()
        single.step()
    return {
        "dense": torch.cat([p.detach().reshape(-1) for p in dense.parameters()]).numpy(),
        "expert": torch.cat([p.detach().reshape(-1) for p in expert.parameters()]).numpy(),
        "reference": torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).numpy(),
    }


@pytest.mark.parametrize("partition", [False, True])
def test_experts_average_over_their_expert_data_parallel_group_only(partition):
    a, b = run_distributed(check_experts, world_size=2, args=(partition,))
    np.testing.assert_array_equal(a["dense"], b["dense"])
    assert not np.array_equal(a["expert"], b["expert"])
    for r in (a, b):
        np.testing.assert_array_equal(r["expert"], r["reference"])
