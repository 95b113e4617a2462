"""µP's learning-rate transfer: a learning-rate sweep at widths 128, 256 and 512 on the quickstart
corpus (the Python stdlib's docstrings), under µP (model.mup_base_width = the narrowest width) and
under standard parametrisation, fp32, one process, a plain PyTorch AdamW loop with the trainer's
parameter groups (llmstack.training.trainer.param_groups) and schedule (warmup + cosine).

Every run of a width starts from the same seed and sees the same blocks in the same order. The
number of heads is fixed, so heads widen with the model (µP's setting for the attention rule).
Printed: the validation loss of every (width, learning rate), the best learning rate per width, and
whether it moved by at most one grid step (a factor of 2) across widths under µP and drifted under
standard parametrisation. The PNG (default bench_mup.png) shows both sweeps side by side.

    python bench/bench_mup.py [--steps 40] [--lrs 1e-3,2e-3,...] [--widths 128,256,512] [--png PATH]
                              [--jobs 2] [--threads 1]

Runs go --jobs at a time in processes of --threads torch threads each: on a loaded 2-core
machine two 1-thread processes were 4-5x faster per step than one 2-thread process.
"""

import argparse
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch
from corpus import stdlib_blocks  # bench/corpus.py

from llmstack import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.loss import causal_lm_loss
from llmstack.training.schedule import warmup_cosine
from llmstack.training.trainer import param_groups

SEQ, VOCAB, LAYERS, HEADS = 64, 2048, 2, 4
DEFAULT_LRS = ",".join(f"{2.0**e:.3g}" for e in range(-11, -6))  # 2^-11 (4.88e-4) ... 2^-7 (7.81e-3)


@torch.no_grad()
def validation_loss(model, blocks, batch_size):
    model.eval()
    nll = [causal_lm_loss(model(input_ids=b[:, :-1]).logits, b[:, 1:]).item() for b in blocks.split(batch_size)]
    return statistics.fmean(nll)


def train_run(width, base, lr, train, valid, args):
    """Validation loss after args.steps steps of one (width, parametrisation, lr); inf if it diverged."""
    torch.set_num_threads(args.threads)
    config = LLMStackConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=SEQ,
        eos_token_id=0,
        mup_base_width=base,
    )
    torch.manual_seed(args.seed)
    model = LLMStackForCausalLM(config).train()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1, lr), lr=lr, betas=(0.9, 0.95))
    schedule = warmup_cosine(optimizer, lr, lr / 10, args.warmup_steps, args.steps)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    for step in range(args.steps):
        batch = train[order[(torch.arange(args.batch) + step * args.batch) % len(train)]]
        loss = model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
        if not torch.isfinite(loss):
            return math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    result = validation_loss(model, valid, args.batch)
    return result if math.isfinite(result) else math.inf


def grid_steps(best_lrs):
    """How many factor-2 grid steps the best learning rate spans across widths."""
    exponents = [math.log2(lr) for lr in best_lrs]
    return round(max(exponents) - min(exponents))


def plot(losses, lrs, widths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    finite = [v for runs in losses.values() for v in runs.values() if math.isfinite(v)]
    top = min(max(finite), min(finite) + 2.5)
    for ax, (name, title) in zip(axes, (("sp", "standard parametrisation"), ("mup", f"µP (base width {widths[0]})"))):
        for width in widths:
            ys = [min(losses[(name, width)][lr], top) for lr in lrs]
            (line,) = ax.plot(lrs, ys, marker="o", label=f"width {width}")
            best = min(lrs, key=lambda lr: losses[(name, width)][lr])
            ax.plot([best], [losses[(name, width)][best]], marker="*", markersize=14, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak learning rate (AdamW)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("validation loss")
    fig.suptitle("Learning-rate sweep across widths on the stdlib docstrings (star: best per width)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help=f"blocks of {SEQ} tokens per step")
    parser.add_argument("--widths", default="128,256,512")
    parser.add_argument("--lrs", default=DEFAULT_LRS, help="comma-separated, factors of 2 apart")
    parser.add_argument("--valid-blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default="bench_mup.png")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, in processes of --threads threads each")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    lrs = sorted(float(lr) for lr in args.lrs.split(","))

    train, valid = stdlib_blocks(VOCAB, SEQ)
    valid = valid[: args.valid_blocks]

    # The base width's runs are one model under both parametrisations (mup_base_width == hidden_size).
    runs = [(name, base, w, lr) for name, base in (("mup", widths[0]), ("sp", None)) for w in widths for lr in lrs]
    runs = sorted((r for r in runs if r[0] == "mup" or r[2] != widths[0]), key=lambda r: -r[2])  # widest first
    losses = {(name, w): {} for name in ("mup", "sp") for w in widths}
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(train_run, w, base, lr, train, valid, args): (name, w, lr) for name, base, w, lr in runs}
        for future in as_completed(futures):
            name, width, lr = futures[future]
            losses[(name, width)][lr] = future.result()
            elapsed = time.perf_counter() - start
            print(
                f"{name:>3} width {width:4d} lr {lr:.3g}: validation loss {future.result():.4f} ({elapsed:.0f} s)",
                flush=True,
            )
    losses[("sp", widths[0])] = losses[("mup", widths[0])]
    print(f"\nvalidation loss after {args.steps} steps of {args.batch} x {SEQ} tokens:")
    print("           " + "".join(f"{lr:>9.3g}" for lr in lrs))
    for (name, width), row in sorted(losses.items()):
        print(f"{name:>3} {width:5d}  " + "".join(f"{row[lr]:9.4f}" for lr in lrs))
    moved = {}
    for name in ("mup", "sp"):
        best = [min(lrs, key=lambda lr: losses[(name, w)][lr]) for w in widths]
        moved[name] = grid_steps(best)
        print(
            f"{name}: best lr per width "
            + ", ".join(f"{w}: {lr:.3g}" for w, lr in zip(widths, best))
            + f"; spans {moved[name]} grid step(s) (factor {2 ** moved[name]})"
        )
    print(
        f"µP best lr moved <= 1 grid step: {moved['mup'] <= 1}; "
        f"standard parametrisation drifted more than µP: {moved['sp'] > moved['mup']}"
    )
    plot(losses, lrs, widths, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
