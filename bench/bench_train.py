"""Training throughput, fp32, one process: llmstack vs transformers' Llama, and the DeepSpeed
engine vs a raw PyTorch loop over the same model.

Targets: llmstack >= 1.0x LlamaForCausalLM tokens/s; DeepSpeed engine overhead <= 5%.
The three loops run interleaved, several rounds, so machine noise hits them alike.

    python bench/bench_train.py [--steps 4] [--rounds 3]
"""

import argparse
import time

import torch
from timing import BASELINE_MODEL  # bench/timing.py
from transformers import LlamaForCausalLM

from llmstack import LLMStackConfig, LLMStackForCausalLM, to_llama

BATCH, SEQ = 8, 256


def raw_step(model, opt, batch):
    loss = model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def llama_step(model, opt, batch):
    loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # HF shifts labels itself
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def engine_step(engine, _, batch):
    loss = engine(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
    engine.backward(loss)
    engine.step()


def tokens_per_s(step, model, opt, batch, steps):
    step(model, opt, batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, batch)
    return steps * BATCH * SEQ / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import deepspeed

    from llmstack.training.distributed import init_distributed

    init_distributed()
    torch.manual_seed(0)
    config = LLMStackConfig(**BASELINE_MODEL)
    batch = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    ours = LLMStackForCausalLM(config).train()
    llama = to_llama(ours).train()
    assert isinstance(llama, LlamaForCausalLM)
    for_engine = LLMStackForCausalLM(config).train()
    engine, *_ = deepspeed.initialize(
        model=for_engine,
        optimizer=torch.optim.AdamW(for_engine.parameters(), lr=1e-4),
        config={"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**9},
    )
    loops = {
        "llmstack (raw loop)": (raw_step, ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
        "transformers Llama": (llama_step, llama, torch.optim.AdamW(llama.parameters(), lr=1e-4)),
        "llmstack (DeepSpeed engine)": (engine_step, engine, None),
    }
    results = {name: [] for name in loops}
    for r in range(args.rounds):
        for name, (step, model, opt) in loops.items():
            results[name].append(tokens_per_s(step, model, opt, batch, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in results.items()), flush=True)
    best = {name: max(v) for name, v in results.items()}
    n_params = sum(p.numel() for p in ours.parameters())
    print(
        f"\nmodel: {n_params / 1e6:.1f}M parameters, batch {BATCH} x {SEQ} tokens, fp32, "
        f"{torch.get_num_threads()} threads"
    )
    for name, value in best.items():
        print(f"{name:<30} {value:8.0f} tokens/s")
    ratio = best["llmstack (raw loop)"] / best["transformers Llama"]
    overhead = 1 - best["llmstack (DeepSpeed engine)"] / best["llmstack (raw loop)"]
    print(f"llmstack / transformers Llama: {ratio:.3f}x (target >= 1.0x)")
    print(f"DeepSpeed engine overhead vs raw loop: {overhead:+.1%} (target <= 5%)")


if __name__ == "__main__":
    main()
