"""Compressed gradient averaging (int8, top-k) and 1-bit Adam against the uncompressed reduction on
2 ranks (gloo, fp32, the quickstart model): bytes per step against the analytic count, step time per
shaped link bandwidth, and the crossover bandwidth below which each method pays.

Stages: ZeRO-0 (gradients all-reduced) and ZeRO-2 (gradients reduce-scattered, then the updated
fp32 weights all-gathered, which int8 and top-k leave as they are; 1-bit Adam's partitioned variant
all-gathers its compressed step instead). 1-bit Adam runs with freeze_step 1, so every measured step
is a compressed one. `--overlap` adds ZeRO-0 with llmstack's overlapped reduction (overlap_comm at
stage 0: buckets of an eighth of the model reduced from gradient hooks while backward runs, for
none, int8 and top-k) against the same methods without it, and uncompressed ZeRO-2 with DeepSpeed's
overlap_comm (same buckets) against the same buckets without it.

`--micro-batch` and `--seq` set the compute per step (default: the quickstart's 8 x 256); fewer tokens
per step for the same model is the regime compression is for, where communication dominates.

Bytes: what one rank sends per step (ring algorithms), from `llmstack.parallel.CommStats` around one
step, against the analytic count: uncompressed, an all-reduce of the fp32 gradients, 2 (W-1)/W x 4 n
(DeepSpeed 0.19's ZeRO-2 all-reduces each bucket whole by default too); compressed, (W-1)
payloads (int8: n bytes and a fp32 scale per 256; top-k: 8 bytes per kept element); plus, at
ZeRO-2, the all-gather of the updated weights, (W-1)/W x 4 n.

Time: with `--link-mbit`, the ranks run in a private network namespace whose loopback is shaped
(bench/shaped_link.py); each round alternates the methods' steps at one rate and keeps each one's
fastest of `--repeats`. Crossover: from the unshaped step times and the bytes on the one loopback
both ranks share, t(bw) = t_unshaped + link_bytes / bw, the bandwidth where a method's step and the
uncompressed one take equally long.

    python bench/bench_compression.py --link-mbit 100 1000 10000
    python bench/bench_compression.py --link-mbit 100 1000 10000 --micro-batch 1 --seq 64 --overlap
"""

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import yaml
from shaped_link import measure_at_rates, run_in_namespace, shape_link

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
CONFIG = {**QUICKSTART["model"], "vocab_size": 4096}  # `llmstack quickstart`'s default --vocab-size
WORLD_SIZE = 2
TOPK_FRACTION = 0.01
METHODS = ("none", "int8", "topk", "onebit")
STAGES = (0, 2)
OVERLAP = ("2 buckets", "2 overlap")  # --overlap: ZeRO-2, uncompressed, buckets of numel / 8
OVERLAP_ZERO0 = "0 overlap"  # --overlap: ZeRO-0 with llmstack's overlapped reduction, buckets of numel / 8
OVERLAP_METHODS = ("none", "int8", "topk")
OVERLAP_BUCKETS = 8


def _engine(stage, method, micro_batch, numel=0):
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.optim import initialize

    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
    zero = {"stage": stage}
    if stage in OVERLAP:
        zero = {"stage": 2, "overlap_comm": stage == OVERLAP[1], "reduce_bucket_size": numel // OVERLAP_BUCKETS}
    if stage == OVERLAP_ZERO0:
        zero = {"stage": 0, "overlap_comm": True, "reduce_bucket_size": numel // OVERLAP_BUCKETS}
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    if method == "onebit":
        optimizer = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 1}}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": optimizer,
        "steps_per_print": 10**9,
    }
    if method in ("int8", "topk"):
        # no warm-up: every measured step is a compressed one (as 1-bit Adam's freeze_step 1)
        config["gradient_compression"] = {"method": method, "topk_fraction": TOPK_FRACTION}
        if method == "topk":
            config["gradient_compression"]["warmup_steps"] = 0
    return initialize(model, config, model.parameters())[0]


def _wire_bytes(stats):
    """Bytes one rank sends for CommStats' buffers (ring: 2 (W-1)/W of an all-reduce, (W-1)/W else)."""
    w = WORLD_SIZE
    return sum(b * (2 if kind == "all_reduce" else 1) * (w - 1) // w for kind, b in stats.bytes.items())


def _measure(rank, world_size, rates, repeats, shaped, micro_batch, seq, overlap):
    import torch.distributed as dist

    from llmstack.parallel import CommStats

    batch = torch.randint(0, CONFIG["vocab_size"], (micro_batch, seq), generator=torch.Generator().manual_seed(rank))

    def step(engine):
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()

    engines = {(stage, method): _engine(stage, method, micro_batch) for stage in STAGES for method in METHODS}
    numel = sum(p.numel() for p in engines[0, "none"].module.parameters())
    for stage in OVERLAP if overlap else ():
        engines[stage, "none"] = _engine(stage, "none", micro_batch, numel)
    for method in OVERLAP_METHODS if overlap else ():
        engines[OVERLAP_ZERO0, method] = _engine(OVERLAP_ZERO0, method, micro_batch, numel)
    result = {"numel": numel, "wire": {}, "sizes": [p.numel() for p in engines[0, "none"].module.parameters()]}
    for key, engine in engines.items():
        step(engine)
        stats = CommStats()
        with stats:
            step(engine)
        result["wire"][key] = _wire_bytes(stats)
    for mbit in rates:
        dist.barrier()
        if rank == 0 and shaped:
            shape_link(mbit)
        dist.barrier()
        times = {key: [] for key in engines}
        for _ in range(repeats):  # alternating, so that all see the same load
            for key, engine in engines.items():
                start = time.perf_counter()
                step(engine)
                times[key].append(time.perf_counter() - start)
        result[mbit] = {key: min(values) for key, values in times.items()}
    return result


def analytic_bytes(stage, method, sizes):
    """Bytes one rank sends per step (2 ranks, ring algorithms, fp32) for parameters of `sizes`."""
    from llmstack.optim.gradient_compression import payload_bytes

    w, numel = WORLD_SIZE, sum(sizes)
    if method == "onebit":
        # Each tensor's slices padded to whole bytes of signs, plus an fp32 scale per tensor: sent
        # to the other ranks in the all-to-all, then again in the all-gather (at ZeRO-0 the averaged
        # momentum, at ZeRO-2 the step).
        packed = sum(-(-n // (8 * w)) for n in sizes) + 4 * len(sizes)
        return 2 * (w - 1) * packed
    weights = (w - 1) * 4 * numel // w if stage else 0  # ZeRO-2's all-gather of the updated weights
    if method == "none":  # DeepSpeed 0.19 all-reduces ZeRO-2's buckets whole (use_multi_rank_bucket_allreduce)
        return 2 * (w - 1) * 4 * numel // w + weights
    return (w - 1) * payload_bytes(method, numel, TOPK_FRACTION) + weights


def _report(r, rates, micro_batch, seq):
    mb, numel = 2**20, r["numel"]
    print(
        f"quickstart model ({numel / 1e6:.2f}M parameters), {WORLD_SIZE} ranks, micro-batch {micro_batch} x {seq}, fp32"
    )
    print(f"{'stage':<7}{'method':<8}{'MiB/step':>10}{'analytic':>10}{'ratio':>8}{'vs none':>9}")
    worst = 0.0
    for stage, method in r["wire"]:
        if stage in (*OVERLAP, OVERLAP_ZERO0):
            continue
        measured, expected = r["wire"][stage, method], analytic_bytes(stage, method, r["sizes"])
        worst = max(worst, abs(measured / expected - 1))
        share = measured / r["wire"][stage, "none"]
        sizes = f"{measured / mb:>10.3f}{expected / mb:>10.3f}{measured / expected:>8.3f}{share:>9.3f}"
        print(f"ZeRO-{stage:<2}{method:<8}{sizes}")
    print(f"largest deviation from the analytic count: {worst:.2%} (target <= 5%)")
    print(
        f"{'link':<14}{'stage':<8}"
        + "".join(f"{m + ' s':>10}" for m in METHODS)
        + "".join(f"{m + '/none':>13}" for m in METHODS[1:])
    )
    for mbit in rates:
        label = f"{mbit} Mbit/s" if mbit else "unshaped"
        for stage in STAGES:
            t = {m: r[mbit][stage, m] for m in METHODS}
            print(
                f"{label:<14}{'ZeRO-' + str(stage):<8}"
                + "".join(f"{t[m]:>10.3f}" for m in METHODS)
                + "".join(f"{t[m] / t['none']:>13.2f}" for m in METHODS[1:])
            )
    for stage in STAGES:
        for method in METHODS[1:]:
            extra = r[None][stage, method] - r[None][stage, "none"]
            saved_bits = 8 * WORLD_SIZE * (r["wire"][stage, "none"] - r["wire"][stage, method])  # both ranks, one link
            crossover = (
                "at any bandwidth (its unshaped step was not longer)"
                if extra <= 0
                else f"below {saved_bits / extra / 1e6:.0f} Mbit/s"
            )
            print(f"crossover ZeRO-{stage} {method}: shorter steps than uncompressed {crossover}")
    if (OVERLAP[0], "none") in r["wire"]:
        _report_overlap(r, rates)
    return 0 if worst <= 0.05 else 1


def _report_overlap(r, rates):
    """Step time without and with overlap, against the two bounds: a step that overlaps takes about
    max(compute, communication), one that does not their sum (compute: the unshaped step)."""

    def line(label, plain_key, overlapped_key):
        link_bits = 8 * WORLD_SIZE * r["wire"][overlapped_key]
        for mbit in rates:
            plain, overlapped = r[mbit][plain_key], r[mbit][overlapped_key]
            text = f"{label:<22}{(f'{mbit} Mbit/s' if mbit else 'unshaped'):<14}{plain:>8.3f}{overlapped:>8.3f}"
            text += f"{overlapped / plain:>8.2f}"
            if mbit:
                compute, comm = r[None][plain_key], link_bits / (mbit * 1e6)
                text += (
                    f"   compute {compute:.3f} + link {comm:.3f} = {compute + comm:.3f}, max {max(compute, comm):.3f}"
                )
            print(text)

    print(f"overlap ({OVERLAP_BUCKETS} buckets): step s without / with, ratio; the bounds at each rate")
    for method in OVERLAP_METHODS:
        line(f"ZeRO-0 {method} (llmstack)", (0, method), (OVERLAP_ZERO0, method))
    line("ZeRO-2 none (DeepSpeed)", (OVERLAP[0], "none"), (OVERLAP[1], "none"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-mbit", type=float, nargs="+", default=[], help="loopback rates to measure (Mbit/s)")
    parser.add_argument("--repeats", type=int, default=2, help="steps per method and rate (the best is kept)")
    parser.add_argument("--micro-batch", type=int, default=QUICKSTART["train"]["micro_batch_size"])
    parser.add_argument("--seq", type=int, default=QUICKSTART["data"]["seq_len"], help="tokens per sequence")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also time overlapped reductions: llmstack's at ZeRO-0, DeepSpeed's at ZeRO-2",
    )
    args = parser.parse_args()
    if args.link_mbit and (code := run_in_namespace()) is not None:
        return code
    measure = partial(_measure, micro_batch=args.micro_batch, seq=args.seq, overlap=args.overlap)
    rates, result = measure_at_rates(measure, args.link_mbit, args.repeats, WORLD_SIZE)
    return _report(result, rates, args.micro_batch, args.seq)


if __name__ == "__main__":
    sys.exit(main())
