"""1-bit Adam against AdamW on 2 ranks (gloo, DeepSpeed ZeRO-0, fp32): bytes and time per step.

Bytes: what one rank puts on the wire per step (ring algorithms) for the engine's fp32 gradient
all-reduce (AdamW, and 1-bit Adam's warm-up) and for 1-bit Adam's compressed all-reduce after the
warm-up, as counted by the optimizer and, independently, from the collectives' buffers seen by
`llmstack.parallel.CommStats`. Target: 1-bit at most 1/20 of fp32 (ideally ~1/32).

Time: best-of-N wall time of a whole training step and of the communication alone (the model's
gradients averaged by `dist.all_reduce` vs `compressed_allreduce`). On one machine gloo moves bytes
through memory, so compression mostly adds work here; the byte ratio is what pays across nodes.

    python bench/bench_onebit.py
"""

import sys

import torch

from llmstack.testing import run_distributed

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}
MICRO_BATCH, SEQ, FREEZE_STEP, REPEATS = 4, 64, 3, 5


def _engine(optimizer_name):

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.optim import initialize

    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
    params = (
        {"lr": 1e-3, "freeze_step": FREEZE_STEP} if optimizer_name == "OneBitAdam" else {"lr": 1e-3, "torch_adam": True}
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": optimizer_name, "params": params},
        "steps_per_print": 10**9,
    }
    return initialize(model, config, model.parameters())[0]


def _measure(rank, world_size):
    import torch.distributed as dist
    from timing import best_time

    from llmstack.optim.compressed_allreduce import (
        SliceLayout,
        allreduce_bytes,
        compressed_allreduce,
        error_feedback_buffers,
    )
    from llmstack.parallel import CommStats

    batch = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(rank))

    def step(engine):
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()

    def collectives(engine):
        stats = CommStats()
        with stats:
            step(engine)
        return sum(stats.bytes.values()) * (world_size - 1) // world_size  # ring: (W-1)/W of each buffer

    adamw, onebit = _engine("AdamW"), _engine("OneBitAdam")
    numel = sum(p.numel() for p in adamw.module.parameters())
    result = {"numel": numel, "fp32_ring": allreduce_bytes(numel, 4, world_size)}
    result["adamw_wire"] = 2 * collectives(adamw)  # all-reduce: 2 (W-1)/W of the buffer
    result["adamw_s"] = best_time(lambda: step(adamw), REPEATS)
    result["warmup_s"] = best_time(lambda: step(onebit), FREEZE_STEP - 1)
    step(onebit)  # the last warm-up step
    result["onebit_wire"] = collectives(onebit)
    result["onebit_counted"] = onebit.basic_optimizer.last_step_bytes
    result["onebit_s"] = best_time(lambda: step(onebit), REPEATS)

    grads = [torch.randn_like(p) for p in adamw.module.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    worker, server = error_feedback_buffers(SliceLayout(grads, world_size))
    result["allreduce_s"] = best_time(lambda: dist.all_reduce(flat), REPEATS)
    result["compressed_s"] = best_time(lambda: compressed_allreduce(grads, worker, server), REPEATS)
    return result


def main():
    r = run_distributed(_measure, world_size=2)[0]
    mb = 2**20
    print(f"model {CONFIG} ({r['numel'] / 1e6:.2f}M parameters), 2 ranks, micro-batch {MICRO_BATCH} x {SEQ}, fp32")
    print(f"{'per rank, per step':<44}{'MiB sent':>10}{'vs fp32':>9}")
    print(f"{'fp32 ring all-reduce of the gradients':<44}{r['fp32_ring'] / mb:>10.3f}{1:>9.3f}")
    print(
        f"{'AdamW (engine all-reduce, CommStats)':<44}"
        f"{r['adamw_wire'] / mb:>10.3f}{r['adamw_wire'] / r['fp32_ring']:>9.3f}"
    )
    print(
        f"{'1-bit Adam after warm-up (counted)':<44}{r['onebit_counted'] / mb:>10.3f}"
        f"{r['onebit_counted'] / r['fp32_ring']:>9.4f}"
    )
    print(
        f"{'1-bit Adam after warm-up (CommStats)':<44}{r['onebit_wire'] / mb:>10.3f}"
        f"{r['onebit_wire'] / r['fp32_ring']:>9.4f}"
    )
    print(f"{'wall time (best of ' + str(REPEATS) + ')':<44}{'s':>10}{'vs AdamW':>9}")
    print(f"{'AdamW step':<44}{r['adamw_s']:>10.3f}{1:>9.2f}")
    print(f"{'1-bit Adam warm-up step':<44}{r['warmup_s']:>10.3f}{r['warmup_s'] / r['adamw_s']:>9.2f}")
    print(f"{'1-bit Adam compressed step':<44}{r['onebit_s']:>10.3f}{r['onebit_s'] / r['adamw_s']:>9.2f}")
    print(f"{'communication only: dist.all_reduce':<44}{r['allreduce_s']:>10.4f}{'':>9}")
    print(
        f"{'communication only: compressed_allreduce':<44}{r['compressed_s']:>10.4f}"
        f"{r['compressed_s'] / r['allreduce_s']:>8.2f}x"
    )
    ratio = r["onebit_counted"] / r["fp32_ring"]
    print(f"1-bit bytes ratio {ratio:.4f} = 1/{1 / ratio:.1f} of fp32 (target <= 1/20)")
    return 0 if ratio <= 1 / 20 and r["onebit_counted"] == r["onebit_wire"] else 1


if __name__ == "__main__":
    sys.exit(main())
