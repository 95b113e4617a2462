"""1-bit Adam with expert parallelism through the trainer (2 gloo ranks, fp32, ZeRO-2: 1-bit Adam's
partitioned variant): in the warm-up (full-precision Adam) a run whose experts are split over the
2 ranks trains as the run with every expert on every rank; after it, the compressed steps keep
learning, and a run resumed from a checkpoint taken
after compression started continues exactly (DeepSpeed's MoE checkpoint asks the optimizer for its
state on data-parallel rank 0 alone, which 1-bit Adam's collective state_dict must survive)."""

import json

from test_moe_ep_training import STEPS, TOLERANCE, losses, moe_run, train_all

from llmstack.testing import run_distributed

FREEZE_STEP, SAVE_INTERVAL = 2, 4  # compressed steps 3-5; the checkpoint at step 4 holds error feedback


def onebit_zero2(path, freeze_step):
    optimizer = {"type": "OneBitAdam", "params": {"freeze_step": freeze_step}}
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": optimizer}))
    return str(path)


def test_onebit_adam_with_split_experts_trains_as_whole_experts_then_compresses_and_resumes(tmp_path, tiny_data):
    warm, compressed = (
        onebit_zero2(tmp_path / "warm.json", 1000),
        onebit_zero2(tmp_path / "compressed.json", FREEZE_STEP),
    )
    saving = {"save_interval": SAVE_INTERVAL, "keep_last": 0}
    runs = [
        (moe_run(tiny_data, tmp_path / "warm_ep1", 1), warm),
        (moe_run(tiny_data, tmp_path / "warm_ep2", 2), warm),
        (moe_run(tiny_data, tmp_path / "compressed_ep2", 2, **saving), compressed),
    ]
    checkpoint = str(tmp_path / "compressed_ep2" / "checkpoints" / f"global_step{SAVE_INTERVAL}")
    resumed = [((moe_run(tiny_data, tmp_path / "resumed", 2), compressed), checkpoint)]
    run_distributed(train_all, 2, args=(runs, resumed, []))

    whole, split = losses(tmp_path / "warm_ep1"), losses(tmp_path / "warm_ep2")
    assert len(whole) == len(split) == STEPS
    assert max(abs(whole[s] - split[s]) for s in whole) <= TOLERANCE
    compressed_losses = losses(tmp_path / "compressed_ep2")
    assert compressed_losses[STEPS] < compressed_losses[1]  # 5.569 -> 4.804 (seed 0)
    continued = losses(tmp_path / "resumed")
    assert sorted(continued) == list(range(SAVE_INTERVAL + 1, STEPS + 1))
    assert all(continued[s] == compressed_losses[s] for s in continued)
