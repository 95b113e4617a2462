"""Per-rank activation memory of one long-sequence training step at context parallel 1 and 2.

A small model (hidden 256, 2 layers, 4 heads, FFN 1024, vocabulary 8192), trained as
`llmstack train` trains a long sequence: fp32, activation checkpointing, tiled MLPs of hidden-size tiles
(train.tiled_mlp_tokens), the chunked loss (no whole logits), Ulysses attention at context
parallel 2. One sample of 8K, 16K and 32K tokens; prints each rank's peak activation memory at
context parallel 1 and 2 and their ratio per length (target: CP2 <= 0.6x CP1).

Each measurement starts fresh processes (one per rank, gloo, one thread each). A rank builds the
model and its AdamW optimizer, takes a warm-up step of 256 tokens (gradients and optimizer state
then exist), and then the measured step: forward, backward, the gradients summed over the
context-parallel ranks, optimizer step. Peak activation memory is the rise of the process's peak
resident set (VmHWM, reset before the step) during the forward and backward pass above its
resident set before the step: activations, the attention's all-to-all buffers and the loss's
chunk of logits; the larger of the ranks' is shown (glibc's mmap threshold fixed at 1 MiB, so that
freed tensors leave the resident set). Time is the whole step's.

`--long 65536` instead runs one training step at that length on 2 ranks and reports its time and
each rank's peak memory (activation rise and whole resident set).

    python bench/bench_context_parallel.py [--lengths 8192 16384 32768] [--tile 256] [--no-tiling]
    python bench/bench_context_parallel.py --long 65536
"""

import argparse
import os
import time

import torch
from timing import reset_resident_peak, resident_bytes, resident_peak_bytes  # bench/timing.py

from llmstack.testing import run_distributed

MIB = 2**20
MODEL = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=65536,
)
WARM_UP_TOKENS = 256


def training_step(rank: int, world_size: int, seq: int, tile_tokens: int) -> dict:
    """One rank's figures for one training step of `seq` tokens split over `world_size` ranks."""
    import torch.distributed as dist

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel.context_parallel import context_parallelize, shard_sequence
    from llmstack.training.tiled_mlp import tile_mlps

    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**MODEL)).train()
    if world_size > 1:
        context_parallelize(model, None, "ulysses")
    if tile_tokens:
        tile_mlps(model, tile_tokens)
    model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(length: int) -> tuple[float, int]:
        """The loss, and the peak resident set of the forward and backward pass (the activations')."""
        tokens = torch.randint(0, MODEL["vocab_size"], (1, length + 1), generator=torch.Generator().manual_seed(length))
        inputs = {"input_ids": tokens[:, :-1], "shift_labels": tokens[:, 1:]}
        if world_size > 1:
            inputs = shard_sequence(inputs, None)
        else:
            inputs["position_ids"] = torch.arange(length).unsqueeze(0)
        loss = model(**inputs, num_items_in_batch=length).loss
        loss.backward()
        activation_peak = resident_peak_bytes()
        if world_size > 1:  # as DeepSpeed sums the context ranks' gradients
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.item(), activation_peak

    step(WARM_UP_TOKENS)
    dist.barrier()
    before = resident_bytes()
    reset_resident_peak()
    start = time.perf_counter()
    loss, activation_peak = step(seq)
    seconds = time.perf_counter() - start
    peak = resident_peak_bytes()
    return {"seconds": seconds, "activation_bytes": activation_peak - before, "peak_bytes": peak, "loss": loss}


def measure(seq: int, context: int, tile_tokens: int) -> list[dict]:
    # glibc serves blocks under its (adaptive, up to 32 MiB) mmap threshold from a heap that keeps
    # freed pages resident, so the resident set would follow the allocator's history, not the live
    # tensors; a fixed 1 MiB threshold returns every larger freed tensor at once. The ranks inherit it.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    return run_distributed(training_step, context, args=(seq, tile_tokens), timeout=3600)


def table(lengths: list[int], tile_tokens: int) -> None:
    rows = []
    for seq in lengths:
        peaks = {}
        for context in (1, 2):
            ranks = measure(seq, context, tile_tokens)
            peaks[context] = max(r["activation_bytes"] for r in ranks)
            seconds = max(r["seconds"] for r in ranks)
            print(f"  {seq:>6} tokens, context parallel {context}: +{peaks[context] / MIB:.0f} MiB, {seconds:.1f} s")
        rows.append((seq, peaks[1], peaks[2]))
    tiling = f"tiled MLP {tile_tokens} tokens" if tile_tokens else "MLP untiled"
    print(f"model {MODEL}; fp32, activation checkpointing, {tiling}, chunked loss, Ulysses")
    print("peak activation memory per rank (resident-set rise during the step):")
    print(f"{'tokens':>7}{'CP1 MiB':>10}{'CP2 MiB':>10}{'CP2/CP1':>9}")
    for seq, one, two in rows:
        print(f"{seq:>7}{one / MIB:>10.0f}{two / MIB:>10.0f}{two / one:>8.2f}x")
    worst = max(two / one for _, one, two in rows)
    print(f"largest CP2/CP1: {worst:.2f}x (target <= 0.6x)")


def long_step(seq: int, tile_tokens: int) -> None:
    ranks = measure(seq, 2, tile_tokens)
    print(f"one training step of {seq} tokens on 2 ranks (context parallel 2, Ulysses), model {MODEL}")
    print(f"fp32, activation checkpointing, tiled MLP {tile_tokens} tokens, chunked loss; loss {ranks[0]['loss']:.3f}")
    print(f"step time {max(r['seconds'] for r in ranks):.1f} s")
    for rank, r in enumerate(ranks):
        print(
            f"rank {rank}: activation peak +{r['activation_bytes'] / MIB:.0f} MiB, "
            f"peak resident set {r['peak_bytes'] / MIB:.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument(
        "--tile", type=int, default=MODEL["hidden_size"], help="train.tiled_mlp_tokens (default: ALST's, hidden size)"
    )
    parser.add_argument("--no-tiling", action="store_true", help="MLPs untiled (train.tiled_mlp_tokens 0)")
    parser.add_argument("--long", type=int, help="one step at this many tokens on 2 ranks instead of the table")
    args = parser.parse_args()
    tile_tokens = 0 if args.no_tiling else args.tile
    if args.long:
        long_step(args.long, tile_tokens)
    else:
        table(args.lengths, tile_tokens)


if __name__ == "__main__":
    main()
