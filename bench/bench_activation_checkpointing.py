"""Activation memory with and without activation checkpointing (train.activation_checkpointing).

Counts the bytes autograd saves for the backward pass (through saved_tensors_hooks, so the number
is exact on any device, CPU included), and the step time, for one forward+backward of the
bench model. Recomputation trades the saved activations of each layer for a second forward.

    python bench/bench_activation_checkpointing.py
"""

import time

import torch
from timing import BASELINE_MODEL  # bench/timing.py

from llmstack import LLMStackConfig, LLMStackForCausalLM

BATCH, SEQ = 8, 256


def saved_bytes_and_time(model, batch):
    """Peak bytes of activations held for backward during one training step, and its seconds."""
    live, peak = {}, [0]

    def pack(t):
        key = id(t)
        live[key] = t.numel() * t.element_size()
        peak[0] = max(peak[0], sum(live.values()))
        return key, t

    def unpack(packed):
        key, t = packed
        live.pop(key, None)
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
    loss.backward()
    return peak[0], time.perf_counter() - start, loss.item()


def main():
    torch.manual_seed(0)
    batch = torch.randint(0, BASELINE_MODEL["vocab_size"], (BATCH, SEQ + 1))
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = LLMStackForCausalLM(LLMStackConfig(**BASELINE_MODEL)).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        saved_bytes_and_time(model, batch)  # warm-up
        results[checkpointing] = saved_bytes_and_time(model, batch)
    (off_bytes, off_s, off_loss), (on_bytes, on_s, on_loss) = results[False], results[True]
    print(f"model {BASELINE_MODEL}, batch {BATCH} x {SEQ}")
    print(f"{'':<28}{'activations':>14}{'step time':>12}")
    print(f"{'no checkpointing':<28}{off_bytes / 2**20:>11.1f} MiB{off_s:>11.2f}s")
    print(f"{'activation checkpointing':<28}{on_bytes / 2**20:>11.1f} MiB{on_s:>11.2f}s")
    print(
        f"activation memory ratio: {on_bytes / off_bytes:.2f}x, time ratio {on_s / off_s:.2f}x, "
        f"losses equal: {on_loss == off_loss}"
    )


if __name__ == "__main__":
    main()
