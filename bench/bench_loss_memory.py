"""Peak memory of the causal LM loss, forward + backward: the whole-logits cross entropy (what
training did before: F.cross_entropy on hidden @ W^T in fp32) against the chunked loss training now
uses (llmstack.models.loss.linear_cross_entropy), which never holds (tokens x vocab) logits.

Target: the chunked loss's peak >= 4x lower at vocabulary 128k x 8k tokens (hidden 1024).

Each measurement runs in a fresh process: the peak is the rise of its resident set (VmHWM, reset
after the inputs exist) on CPU, or torch.cuda.max_memory_allocated on a GPU. Rounds alternate the
two losses. The whole-logits loss at the default shape needs about 12-16 GB: use --tokens to shrink
it on a small machine (its peak grows linearly with tokens).

    python bench/bench_loss_memory.py [--vocab 131072] [--tokens 8192] [--hidden 1024] [--rounds 2]
"""

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from timing import reset_resident_peak, resident_bytes, resident_peak_bytes  # bench/timing.py

from llmstack.models.loss import linear_cross_entropy

GIB = 2**30


def whole_logits_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).float(), targets)


LOSSES = {"whole_logits": whole_logits_loss, "chunked": linear_cross_entropy}


def measure(name: str, vocab: int, tokens: int, hidden_size: int, device: str) -> dict:
    """Peak bytes above the inputs (and the weight gradient's own size) and seconds of one forward + backward."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    else:
        reset_resident_peak()
        start_bytes = resident_bytes()
    start = time.perf_counter()
    LOSSES[name](hidden, weight, targets).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start_bytes
    else:
        peak = resident_peak_bytes() - start_bytes
    return {"peak_bytes": peak, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--measure", choices=sorted(LOSSES), help=argparse.SUPPRESS)  # one child run
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.vocab, args.tokens, args.hidden, args.device)))
        return

    shape = ["--vocab", str(args.vocab), "--tokens", str(args.tokens), "--hidden", str(args.hidden)]
    print(f"loss forward+backward, vocab {args.vocab} x {args.tokens} tokens, hidden {args.hidden}, {args.device}")
    results: dict[str, list[dict]] = {name: [] for name in LOSSES}
    for _ in range(args.rounds):
        for name in LOSSES:
            command = [sys.executable, __file__, *shape, "--device", args.device, "--measure", name]
            child = subprocess.run(command, check=True, capture_output=True, text=True)
            result = json.loads(child.stdout.strip().splitlines()[-1])
            results[name].append(result)
            print(f"  {name:13s} peak {result['peak_bytes'] / GIB:7.2f} GiB  {result['seconds']:6.1f} s")
    peak = {name: min(r["peak_bytes"] for r in runs) for name, runs in results.items()}
    seconds = {name: min(r["seconds"] for r in runs) for name, runs in results.items()}
    print(f"peak memory: whole logits {peak['whole_logits'] / GIB:.2f} GiB, chunked {peak['chunked'] / GIB:.2f} GiB")
    print(f"peak ratio whole/chunked: {peak['whole_logits'] / peak['chunked']:.1f}x (target >= 4x)")
    print(f"time ratio chunked/whole: {seconds['chunked'] / seconds['whole_logits']:.2f}x (best of {args.rounds})")


if __name__ == "__main__":
    main()
