"""Long-context training cost, dense causal attention vs BigBird block-sparse attention.

One training step (forward + backward, activation checkpointing on, batch 1, fp32) of a small
model at 2K, 4K, 8K and 16K tokens per sequence; prints the time and the peak memory per token of
each length relative to 2K, per attention pattern. Targets: sparse <= 1.5x per token at 16K.

Each (pattern, length) runs in a fresh process, so its peak is its own: peak memory is the
process's peak resident set (getrusage ru_maxrss) minus its resident set just before the first
step (model and batch built; no optimizer), i.e. what the step itself added. Time is the fastest
of `--steps` steps after that first one, as wall-clock seconds and as the process's CPU seconds
(all threads; less disturbed when other work shares the cores). One thread by default: then
the CPU seconds are the work itself, without the spin-waits of threads whose partner was
descheduled, which on a loaded machine swamp the small operations of short sequences. Rounds interleave all the runs,
so machine noise hits them alike; each figure is the best over rounds.

    python bench/bench_long_context.py [--rounds 2] [--steps 2] [--threads 1] [--lengths 2048 4096 8192 16384]
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from llmstack import LLMStackConfig, LLMStackForCausalLM

MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=16384,
)
# Each 64-token query block reads its own block, the one before, the first block and one random
# earlier block: 256 keys per query at any length.
BIGBIRD = dict(
    attention_pattern="bigbird",
    sparse_block_size=64,
    sparse_window_blocks=1,
    sparse_global_blocks=1,
    sparse_random_blocks=1,
)
PATTERNS = {"dense": {}, "bigbird": BIGBIRD}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(pattern: str, seq: int, steps: int, threads: int) -> dict:
    """One process's figures: wall and CPU seconds (all threads) of its fastest step, and the bytes
    its first step added."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**MODEL, **PATTERNS[pattern])).train()
    model.activation_checkpointing_enable()
    batch = torch.randint(0, MODEL["vocab_size"], (1, seq + 1))

    def step():
        model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss.backward()

    before = resident_bytes()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # ru_maxrss is in KiB on Linux
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"seconds": min(wall), "cpu_seconds": min(cpu), "peak_bytes": peak}


def run_one(pattern: str, seq: int, steps: int, threads: int) -> dict:
    command = [sys.executable, __file__, "--one", pattern, str(seq), "--steps", str(steps), "--threads", str(threads)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--one", nargs=2, metavar=("PATTERN", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.steps, args.threads)))
        return

    best: dict[tuple[str, int], dict] = {}
    for r in range(args.rounds):
        for seq in args.lengths:
            for pattern in PATTERNS:
                result = run_one(pattern, seq, args.steps, args.threads)
                key = (pattern, seq)
                if key in best:
                    result = {k: min(v, best[key][k]) for k, v in result.items()}
                best[key] = result
                print(
                    f"round {r + 1}: {pattern:<8} {seq:>6} tokens: step {result['seconds']:.2f}s, "
                    f"peak +{result['peak_bytes'] / 2**20:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )

    base = args.lengths[0]
    print(
        f"model {MODEL}, bigbird {BIGBIRD}; batch 1, fp32, activation checkpointing, "
        f"{args.threads} thread(s); best of {args.rounds} rounds x {args.steps} steps"
    )
    print(f"per token, relative to {base} tokens: wall time, CPU time, peak memory")
    print(f"{'pattern':<9}{'tokens':>7}{'step s':>8}{'cpu s':>8}{'peak MiB':>10}{'wall':>8}{'cpu':>8}{'memory':>8}")
    ratios = {}
    for pattern in PATTERNS:
        ref = best[(pattern, base)]
        for seq in args.lengths:
            got = best[(pattern, seq)]
            ratios[(pattern, seq)] = [
                (got[k] / seq) / (ref[k] / base) for k in ("seconds", "cpu_seconds", "peak_bytes")
            ]
            wall, cpu, memory = ratios[(pattern, seq)]
            print(
                f"{pattern:<9}{seq:>7}{got['seconds']:>8.2f}{got['cpu_seconds']:>8.2f}"
                f"{got['peak_bytes'] / 2**20:>10.0f}{wall:>7.2f}x{cpu:>7.2f}x{memory:>7.2f}x"
            )
    last = args.lengths[-1]
    wall, cpu, memory = ratios[("bigbird", last)]
    print(
        f"bigbird per token at {last} vs {base}: wall {wall:.2f}x, cpu {cpu:.2f}x, memory {memory:.2f}x "
        "(target <= 1.5x)"
    )
    dense_wall, dense_cpu, dense_memory = ratios[("dense", last)]
    print(
        f"dense per token at {last} vs {base}: wall {dense_wall:.2f}x, cpu {dense_cpu:.2f}x, memory {dense_memory:.2f}x"
    )
    step_ratio = best[("bigbird", last)]["seconds"] / best[("dense", last)]["seconds"]
    print(f"at {last} tokens a bigbird step takes {step_ratio:.2f}x the dense step's wall time")


if __name__ == "__main__":
    main()
