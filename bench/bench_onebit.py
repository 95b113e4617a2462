"""1-bit Adam against AdamW on 2 ranks (gloo, DeepSpeed ZeRO-0, fp32, the quickstart model): bytes and
step time per link bandwidth, and the crossover bandwidth below which 1-bit Adam pays.

Bytes: what one rank puts on the wire per step (ring algorithms) for the engine's fp32 gradient
all-reduce (AdamW) and for 1-bit Adam's compressed all-reduce after the warm-up, as counted by the
optimizer and, independently, from the collectives' buffers seen by `llmstack.parallel.CommStats`.

Time: with `--link-mbit`, the bench re-executes itself inside a private network namespace
(`unshare -n`, so root) whose loopback, the only link the two ranks share, is shaped with a token
bucket (`tc qdisc ... tbf`); rank 0 reshapes it between rounds. Each round measures AdamW and
1-bit Adam (after its warm-up) at one rate, alternating steps, and keeps each one's fastest of
`--repeats`, so every ratio compares steps taken under the same load. Without `--link-mbit` only the unshaped loopback
is measured (gloo then moves bytes through memory, and compression mostly adds work).

Crossover: the bandwidth at which both steps take equally long, derived from the unshaped round
(each optimizer's compute and overhead, compression included) plus the bytes both ranks push through the one shaped
loopback: t(bw) = t_unshaped + bytes_on_link / bw. The measured rates check that model.

    python bench/bench_onebit.py --link-mbit 50 100 400 1000
"""

import argparse
import sys
from pathlib import Path

import torch
import yaml
from shaped_link import measure_at_rates, run_in_namespace, shape_link

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
CONFIG = {**QUICKSTART["model"], "vocab_size": 4096}  # `llmstack quickstart`'s default --vocab-size
MICRO_BATCH, SEQ = QUICKSTART["train"]["micro_batch_size"], QUICKSTART["data"]["seq_len"]
FREEZE_STEP = 3
WORLD_SIZE = 2


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


def _measure(rank, world_size, rates, repeats, shaped):
    import time

    import torch.distributed as dist

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
    result = {"numel": numel, "adamw_wire": 2 * collectives(adamw)}  # all-reduce: 2 (W-1)/W of the buffer
    for _ in range(FREEZE_STEP):
        step(onebit)
    result["onebit_wire"] = collectives(onebit)
    result["onebit_counted"] = onebit.basic_optimizer.last_step_bytes
    for mbit in rates:
        dist.barrier()
        if rank == 0 and shaped:
            shape_link(mbit)
        dist.barrier()
        step(adamw), step(onebit)  # refill the token bucket's queue at the new rate
        times = {"adamw_s": [], "onebit_s": []}
        for _ in range(repeats):  # alternating, so that both see the same load
            for key, engine in (("adamw_s", adamw), ("onebit_s", onebit)):
                start = time.perf_counter()
                step(engine)
                times[key].append(time.perf_counter() - start)
        result[mbit] = {key: min(values) for key, values in times.items()}  # the least disturbed step
    return result


def _crossover_mbit(unshaped, link_bytes):
    """The bandwidth (Mbit/s) at which t_unshaped + link_bytes / bw is equal for both optimizers."""
    extra_compute = unshaped["onebit_s"] - unshaped["adamw_s"]
    saved_bits = 8 * (link_bytes["adamw"] - link_bytes["onebit"])
    return float("inf") if extra_compute <= 0 else saved_bits / extra_compute / 1e6


def _report(r, rates):
    mb = 2**20
    print(f"quickstart model {CONFIG} ({r['numel'] / 1e6:.2f}M parameters)")
    print(f"{WORLD_SIZE} ranks, 1 thread each, micro-batch {MICRO_BATCH} x {SEQ}, fp32, ZeRO-0")
    print(f"{'per rank, per step':<40}{'MiB sent':>10}{'vs AdamW':>10}")
    print(f"{'AdamW (engine all-reduce, CommStats)':<40}{r['adamw_wire'] / mb:>10.3f}{1:>10.3f}")
    for how, key in (("counted", "onebit_counted"), ("CommStats", "onebit_wire")):
        print(f"{'1-bit Adam after warm-up (' + how + ')':<40}{r[key] / mb:>10.3f}{r[key] / r['adamw_wire']:>10.4f}")
    # Both ranks send through the same loopback, so the link carries every rank's bytes.
    link_bytes = {"adamw": WORLD_SIZE * r["adamw_wire"], "onebit": WORLD_SIZE * r["onebit_counted"]}
    unshaped = r[None]
    print(f"{'link':<14}{'AdamW s':>10}{'1-bit s':>10}{'1-bit/AdamW':>13}{'model AdamW':>13}{'model 1-bit':>13}")
    for mbit in rates:
        model = {k: unshaped[f"{k}_s"] + (8 * link_bytes[k] / (mbit * 1e6) if mbit else 0) for k in link_bytes}
        m = r[mbit]
        print(
            f"{(f'{mbit} Mbit/s' if mbit else 'unshaped'):<14}{m['adamw_s']:>10.3f}{m['onebit_s']:>10.3f}"
            f"{m['onebit_s'] / m['adamw_s']:>13.2f}{model['adamw']:>13.3f}{model['onebit']:>13.3f}"
        )
    crossover = _crossover_mbit(unshaped, link_bytes)
    derived = "derived from the unshaped step times and the bytes on the link"
    if crossover == float("inf"):
        print(f"crossover ({derived}): none, 1-bit Adam's step was not longer even unshaped")
    else:
        print(f"crossover ({derived}): {crossover:.0f} Mbit/s; 1-bit Adam's step is shorter below it")
    measured = [mbit for mbit in rates if mbit and r[mbit]["onebit_s"] < r[mbit]["adamw_s"]]
    print(f"measured rates where 1-bit Adam's step was shorter: {measured or 'none'} Mbit/s")
    return 0 if r["onebit_counted"] == r["onebit_wire"] else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-mbit", type=float, nargs="+", default=[], help="loopback rates to measure (Mbit/s)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per optimizer and rate (the best is kept)")
    args = parser.parse_args()
    if args.link_mbit and (code := run_in_namespace()) is not None:
        return code  # a private network namespace ran it, so that shaping its loopback touches nothing else
    rates, result = measure_at_rates(_measure, args.link_mbit, args.repeats, WORLD_SIZE)
    return _report(result, rates)


if __name__ == "__main__":
    sys.exit(main())
