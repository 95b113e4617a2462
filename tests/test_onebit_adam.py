"""1-bit Adam: sign packing, the compressed all-reduce, equality with (frozen-variance) Adam on one
rank, the ds_config wiring, and on 2 ranks (gloo) through the DeepSpeed engine: bytes per step,
loss against AdamW, and bit-for-bit resume from a DeepSpeed checkpoint."""

import copy
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.optim import OneBitAdam, initialize, resolve_optimizer
from llmstack.optim.compressed_allreduce import (
    allreduce_bytes,
    compressed_allreduce,
    error_feedback_buffers,
    pack_signs,
    slice_layout,
    unpack_signs,
)
from llmstack.parallel import CommStats
from llmstack.testing import run_distributed

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"

# The small LM task: byte-level next-token prediction on a stdlib source file.
LM_STEPS, LM_FREEZE_STEP, LM_LR = 100, 30, 3e-3
RESUME_FREEZE_STEP, RESUME_SAVE_AT, RESUME_MORE = 3, 6, 4


# ---- one process


def test_pack_signs_is_numpy_packbits_and_unpacks_to_signs():
    x = torch.randn(3, 64)
    x[0, :5] = 0.0  # zero counts as positive
    packed = pack_signs(x)
    assert torch.equal(packed, torch.from_numpy(np.packbits((x >= 0).numpy().reshape(-1))))
    assert torch.equal(unpack_signs(packed).view_as(x), torch.where(x >= 0, 1.0, -1.0))


def test_one_rank_is_adamw_then_adam_with_frozen_variance():
    hyper = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    freeze_step = 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    onebit = OneBitAdam(model.parameters(), freeze_step=freeze_step, **hyper)
    adamw = torch.optim.AdamW(reference.parameters(), **hyper)
    for step in range(1, 11):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for m in (model, reference):
            m.zero_grad()
            m(x).square().mean().backward()
        onebit.step()
        if step <= freeze_step:
            adamw.step()
            exact = {"rtol": 0, "atol": 0}
        else:
            frozen_variance_adam_step(adamw, step, freeze_step)
            exact = {}
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, **exact)
    assert onebit.last_step_bytes == 0


@torch.no_grad()
def frozen_variance_adam_step(adamw, step, freeze_step):
    """AdamW's update with exp_avg_sq and its bias correction as they were at freeze_step."""
    for group in adamw.param_groups:
        (beta1, beta2), lr = group["betas"], group["lr"]
        for p in group["params"]:
            state = adamw.state[p]
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            denom = state["exp_avg_sq"].sqrt() / (1 - beta2**freeze_step) ** 0.5 + group["eps"]
            p.mul_(1 - lr * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def test_resolve_optimizer_builds_onebit_adam_from_its_ds_config():
    config = json.loads((DS_CONFIGS / "onebit_adam.json").read_text())
    config["optimizer"]["params"].update(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    params = [torch.nn.Parameter(torch.zeros(3))]
    resolved, optimizer = resolve_optimizer(config, params)
    assert isinstance(optimizer, OneBitAdam) and "optimizer" not in resolved and "optimizer" in config
    assert optimizer.freeze_step == config["optimizer"]["params"]["freeze_step"]
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95) and optimizer.param_groups[0]["weight_decay"] == 0.1

    adamw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    assert resolve_optimizer(adamw, params) == (adamw, None)


@pytest.mark.parametrize(
    "change, kwargs, message",
    [
        ({"zero_optimization": {"stage": 3}}, {}, "ZeRO stages 0, 1 and 2"),
        ({}, {"pipeline_stages": 2}, "pipeline parallelism"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"cuda_aware": True}}}, {}, "unknown OneBitAdam parameter"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 0}}}, {}, "freeze_step"),
    ],
)
def test_resolve_optimizer_rejects_what_onebit_adam_cannot_do(change, kwargs, message):
    config = {**json.loads((DS_CONFIGS / "onebit_adam.json").read_text()), **change}
    with pytest.raises(UserError, match=message):
        resolve_optimizer(config, [torch.nn.Parameter(torch.zeros(3))], **kwargs)


# ---- 2 ranks, one launch


def allreduce_checks(rank, world_size, calls=40):
    """Average fixed tensors repeatedly: outputs per call, the true mean, bytes per call."""
    g = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (200,), (7,), (16, 16)]
    # Tensors of very different magnitudes: each keeps its own scale.
    local = [torch.randn(s, generator=g) * 10.0**i for i, s in enumerate(shapes)]
    gathered = [torch.zeros(world_size, *t.shape) for t in local]
    for t, out in zip(local, gathered):
        torch.distributed.all_gather(list(out.unbind(0)), t)
    mean = [out.mean(dim=0) for out in gathered]
    worker, server = error_feedback_buffers(slice_layout(local, world_size))
    outputs, sent = [], []
    for _ in range(calls):
        tensors = [t.clone() for t in local]
        sent.append(compressed_allreduce(tensors, worker, server))
        outputs.append(tensors)
    return {"outputs": outputs, "mean": mean, "sent": sent, "numel": sum(t.numel() for t in local)}


def corpus():
    return torch.tensor(list(Path(textwrap.__file__).read_bytes()), dtype=torch.long)


def lm_batches(rank, steps, batch=8, seq=64):
    data, g = corpus(), torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        yield torch.stack([data[s : s + seq] for s in starts])


SMALL_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def quickstart_model():
    """The quickstart's architecture (configs/quickstart.yaml), here on bytes (vocabulary 256)."""
    return yaml.safe_load((DS_CONFIGS.parent / "configs" / "quickstart.yaml").read_text())["model"]


def lm_engine(optimizer_name, freeze_step, model_fields=SMALL_MODEL, **precision):
    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(vocab_size=256, **model_fields))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": optimizer_name, "params": {"lr": LM_LR, "weight_decay": 0.0}},
        **precision,
    }
    if optimizer_name == "OneBitAdam":
        config["optimizer"]["params"]["freeze_step"] = freeze_step
    else:
        config["optimizer"]["params"]["torch_adam"] = True
    return initialize(model, config, model.parameters())[0]


def train(engine, batches):
    losses, sent = [], []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        sent.append(getattr(engine.basic_optimizer, "last_step_bytes", None))
    return losses, sent


def weights(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def resume_checks(rank, save_dir):
    """Train, save after the warm-up, train on; reload into a fresh engine and train the same steps."""
    batches = list(lm_batches(rank, RESUME_SAVE_AT + RESUME_MORE))
    engine = lm_engine("OneBitAdam", RESUME_FREEZE_STEP)
    train(engine, batches[:RESUME_SAVE_AT])
    engine.save_checkpoint(save_dir, tag="resume")
    errors = {k: v.clone() for k, v in engine.basic_optimizer.state["onebit"].items() if torch.is_tensor(v)}
    continued = train(engine, batches[RESUME_SAVE_AT:])[0], weights(engine)

    fresh = lm_engine("OneBitAdam", RESUME_FREEZE_STEP)
    fresh.load_checkpoint(save_dir, tag="resume")
    restored = {k: v.clone() for k, v in fresh.basic_optimizer.state["onebit"].items() if torch.is_tensor(v)}
    resumed = train(fresh, batches[RESUME_SAVE_AT:])[0], weights(fresh)
    return {"continued": continued, "resumed": resumed, "errors": errors, "restored": restored}


def collectives_of_one_step(engine, ids):
    """Bytes per collective kind (buffer sizes, llmstack.parallel.CommStats) of one more step."""
    stats = CommStats()
    with stats:
        train(engine, [ids])
    return dict(stats.bytes)


def check_all(rank, world_size, save_dir):
    adamw = lm_engine("AdamW", None, quickstart_model())
    onebit = lm_engine("OneBitAdam", LM_FREEZE_STEP, quickstart_model())
    results = {
        "allreduce": allreduce_checks(rank, world_size),
        "adamw": train(adamw, lm_batches(rank, LM_STEPS)),
        "onebit": train(onebit, lm_batches(rank, LM_STEPS)),
    }
    ids = next(lm_batches(rank + 10, 1))
    return as_numpy(
        {
            **results,
            "adamw_collectives": collectives_of_one_step(adamw, ids),
            "onebit_collectives": collectives_of_one_step(onebit, ids),
            "onebit_counted": onebit.basic_optimizer.last_step_bytes,
            "engine_allreduce": onebit.enable_backward_allreduce,
            "numel": sum(p.numel() for p in onebit.module.parameters()),
            "resume": resume_checks(rank, save_dir),
            "weights": torch.cat([w.reshape(-1) for w in weights(onebit)]),
            # DeepSpeed's bf16 wrapper at ZeRO-0 hands 1-bit Adam fp32 master weights and gradients (and
            # takes one zero-gradient step at initialization, which counts as a warm-up step).
            "bf16": train(lm_engine("OneBitAdam", 4, bf16={"enabled": True}), lm_batches(rank, 8))[0],
        }
    )


def as_numpy(tree):
    """Tensors as numpy arrays: tensors sent between processes share memory with a process that exits."""
    if isinstance(tree, torch.Tensor):
        return tree.numpy()
    if isinstance(tree, dict):
        return {k: as_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(as_numpy(v) for v in tree)
    return tree


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(check_all, world_size=2, args=(str(tmp_path_factory.mktemp("onebit_ckpt")),))


def test_compressed_allreduce_agrees_across_ranks_and_error_feedback_converges(results):
    a, b = (r["allreduce"] for r in results)
    for out_a, out_b in zip(a["outputs"], b["outputs"]):
        for x, y in zip(out_a, out_b):
            np.testing.assert_array_equal(x, y)
    # One call keeps only signs and a scale per tensor; with error feedback what is lost comes back
    # in later calls, so the average over calls converges to the mean (error ~ 1/calls).
    calls = len(a["outputs"])
    for i, mean in enumerate(a["mean"]):
        error = {
            n: relative_error(np.mean([out[i] for out in a["outputs"][:n]], axis=0), mean)
            for n in (1, calls // 4, calls)
        }
        assert error[1] > 0.5
        assert error[calls] < min(0.15, error[calls // 4] / 2)


def relative_error(x, reference):
    return np.linalg.norm(x - reference) / np.linalg.norm(reference)


def test_bytes_per_step_after_warmup_are_at_most_a_twentieth_of_fp32_allreduce(results):
    for r in results:
        full = allreduce_bytes(r["numel"], 4, 2)
        sent = r["onebit"][1]
        assert sent[:LM_FREEZE_STEP] == [full] * LM_FREEZE_STEP
        assert all(0 < s <= full / 20 for s in sent[LM_FREEZE_STEP:])
        assert all(s <= allreduce_bytes(r["allreduce"]["numel"], 4, 2) / 20 for s in r["allreduce"]["sent"])


def test_collectives_seen_by_the_dispatcher_match_the_count(results):
    """An independent count: CommStats sees every c10d collective, the engine's included."""
    for r in results:
        adamw, onebit = r["adamw_collectives"], r["onebit_collectives"]
        assert adamw == {"all_reduce": 4 * r["numel"]}  # the engine's gradient all-reduce, fp32
        assert set(onebit) == {"all_to_all", "all_gather"}  # and the engine's is off under 1-bit Adam
        # Ring algorithms put (W-1)/W of each buffer on the wire; W = 2.
        assert (onebit["all_to_all"] + onebit["all_gather"]) // 2 == r["onebit_counted"]
        assert r["onebit_counted"] <= allreduce_bytes(r["numel"], 4, 2) / 20


def test_every_rank_applies_the_same_update(results):
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])


def test_trains_under_bf16(results):
    for r in results:
        assert all(np.isfinite(r["bf16"])) and r["bf16"][-1] < r["bf16"][0]


def test_engine_leaves_gradient_communication_to_onebit_adam(results):
    for r in results:
        assert r["engine_allreduce"] is False
        # During the warm-up 1-bit Adam is AdamW on the same averaged gradients.
        assert r["onebit"][0][: LM_FREEZE_STEP + 1] == r["adamw"][0][: LM_FREEZE_STEP + 1]


def test_final_loss_within_5_percent_of_adamw(results):
    for r in results:
        final_adamw = np.mean(r["adamw"][0][-10:])
        final_onebit = np.mean(r["onebit"][0][-10:])
        # The task is learned: AdamW ends at 0.50-0.51 of its first loss (2.657 and 2.708 of ~5.32 on
        # two machines of this kind); 0.6 leaves room for other CPUs' kernels, and an untrained model stays >0.9.
        assert final_adamw < 0.6 * r["adamw"][0][0]
        assert abs(final_onebit - final_adamw) <= 0.05 * final_adamw


def test_resume_from_checkpoint_is_bit_for_bit(results):
    for r in results:
        resume = r["resume"]
        assert set(resume["errors"]) == {"worker_error", "server_error"}
        for key, value in resume["errors"].items():
            np.testing.assert_array_equal(resume["restored"][key], value)
        assert resume["resumed"][0] == resume["continued"][0]
        for p, q in zip(resume["resumed"][1], resume["continued"][1]):
            np.testing.assert_array_equal(p, q)
    # The two ranks' error feedback differs: each rank restored its own.
    worker_errors = [r["resume"]["errors"]["worker_error"] for r in results]
    assert not np.array_equal(*worker_errors)
