"""Training throughput, fp32, one process: llmstack (eager and with compiled blocks, as
`train.compile: true`) vs transformers' Llama, `llmstack train`'s default step (the DeepSpeed
engine, compiled as `train.compile: auto` decides for continue_pretraining.yaml's 2000 steps) vs a raw PyTorch
loop, and the fraction of the fp32 matmul peak each reaches (model FLOPs 6N + attention, as the
throughput meter counts them).

Targets: `llmstack train`'s default step >= 1.25x LlamaForCausalLM tokens/s; compiled llmstack
>= 85% of the matmul peak; DeepSpeed engine overhead <= 5%. The loops and a matmul-peak probe run
interleaved, several rounds, taking turns step by step, so machine noise hits them alike; a loop's rate in a round is
its fastest step; ratios are taken within a round and reported as the median and range over the
rounds. Every loop steps torch's fused AdamW, as the shipped ds_configs have `llmstack train` do.
Each round also times the model's own matmul shapes alone (forward and backward): the rate no
step's 6N FLOPs can beat, printed against the peak as a ceiling for the MFU target.

    python bench/bench_train.py [--steps 4] [--rounds 3] [--no-compile] [--cpu-time]

--cpu-time runs one thread and times everything (loops and peak) by the thread's CPU time instead of
the wall clock: on a machine shared with other jobs a step's CPU time hardly depends on how often it
was preempted, its wall time does (memory-bandwidth and cache contention still show).
"""

import argparse
import statistics
import time
from collections import Counter

import torch
from timing import BASELINE_MODEL  # bench/timing.py
from torch import nn
from transformers import LlamaForCausalLM

from llmstack import LLMStackConfig, LLMStackForCausalLM, to_llama
from llmstack.monitor.throughput import flops_per_token, measure_peak_flops
from llmstack.training.compile import compile_decoder_layers, compile_wanted
from llmstack.training.config import TrainConfig

BATCH, SEQ = 8, 256
DEFAULT = "llmstack train default"
DEFAULT_RUN_STEPS = 2000  # configs/continue_pretraining.yaml's max_steps
PEAK = "fp32 matmul peak"
CEILING = "model's matmuls alone"


def adamw(model):
    """AdamW as `llmstack train` runs it (the shipped ds_configs set torch's fused AdamW)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


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


def one_round(loops, batch, steps, clock=time.perf_counter):
    """{loop: tokens/s} from its fastest of `steps` steps, the loops taking turns step by step so
    that a burst of other load slows one step of each rather than all steps of one."""
    times = {name: [] for name in loops}
    for _ in range(steps):
        for name, (step, model, opt) in loops.items():
            start = clock()
            step(model, opt, batch)
            times[name].append(clock() - start)
    return {name: BATCH * SEQ / min(t) for name, t in times.items()}


def measure_model_matmuls(model, tokens, clock=time.perf_counter, repeats=3):
    """FLOP/s of the model's own matmuls, alone: every Linear's forward and its two backward
    matmuls at `tokens` rows, timed shape by shape (best of `repeats`), weighted by how often each
    shape occurs. No training step can turn its 6N FLOPs faster than this on this machine."""
    shapes = Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear))
    flops = seconds = 0.0
    for (fan_in, fan_out), count in shapes.items():
        x, w, grad = torch.randn(tokens, fan_in), torch.randn(fan_out, fan_in), torch.randn(tokens, fan_out)
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            x @ w.t(), grad @ w, grad.t() @ x
            best = min(best, clock() - start)
        flops += count * 6 * tokens * fan_in * fan_out
        seconds += count * best
    return flops / seconds


def spread(values):
    return f"median {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled llmstack loop")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time (loaded machines)")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)

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
    engine_compiled = not args.no_compile and compile_wanted(TrainConfig().compile, DEFAULT_RUN_STEPS)
    if engine_compiled:
        compile_decoder_layers(for_engine)
    engine, *_ = deepspeed.initialize(
        model=for_engine,
        optimizer=adamw(for_engine),
        config={"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**9},
    )
    loops = {
        "llmstack (raw loop)": (raw_step, ours, adamw(ours)),
        "transformers Llama": (llama_step, llama, adamw(llama)),
        DEFAULT: (engine_step, engine, None),
    }
    if not args.no_compile:
        compiled = LLMStackForCausalLM(config).train()
        compile_decoder_layers(compiled)
        start = time.perf_counter()
        opt = adamw(compiled)
        raw_step(compiled, opt, batch)
        print(f"compile (first step of llmstack compiled): {time.perf_counter() - start:.0f} s", flush=True)
        loops["llmstack compiled (raw loop)"] = (raw_step, compiled, opt)
    results = {name: [] for name in [*loops, PEAK, CEILING]}
    for step, model, opt in loops.values():
        step(model, opt, batch)  # warm-up
    for r in range(args.rounds):
        for name, value in one_round(loops, batch, args.steps, clock).items():
            results[name].append(value)
        results[PEAK].append(measure_peak_flops("cpu", seconds=2.0, clock=clock))
        results[CEILING].append(measure_model_matmuls(ours, BATCH * SEQ, clock))
        print(
            f"round {r + 1}: "
            + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in results.items() if n in loops)
            + "".join(f", {n} {results[n][-1] / 1e9:.0f} GFLOP/s" for n in (PEAK, CEILING)),
            flush=True,
        )
    n_params = sum(p.numel() for p in ours.parameters())
    flops = flops_per_token(config, SEQ)
    print(
        f"\nmodel: {n_params / 1e6:.1f}M parameters, batch {BATCH} x {SEQ} tokens, fp32, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        + ("timed by thread CPU time" if args.cpu_time else "timed by wall clock")
    )
    for name, values in results.items():
        unit, scale = ("tokens/s", 1) if name in loops else ("GFLOP/s", 1e9)
        print(f"{name:<30} best {max(values) / scale:8.0f} {unit}, rounds: {[round(v / scale) for v in values]}")

    def per_round(a, b):
        return [x / y for x, y in zip(results[a], results[b])]

    print(f"llmstack / transformers Llama: {spread(per_round('llmstack (raw loop)', 'transformers Llama'))}")
    print(
        f"{DEFAULT} ({'compiled' if engine_compiled else 'eager'} DeepSpeed engine) / transformers Llama: "
        f"{spread(per_round(DEFAULT, 'transformers Llama'))} (target >= 1.25)"
    )
    names = ["llmstack (raw loop)", "transformers Llama"]
    if not args.no_compile:
        name = "llmstack compiled (raw loop)"
        print(f"llmstack compiled / transformers Llama: {spread(per_round(name, 'transformers Llama'))}")
        names.insert(0, name)
    for name in names:
        mfu = [t * flops / peak for t, peak in zip(results[name], results[PEAK])]
        print(f"{name} / {PEAK}: {spread(mfu)}" + (" (target >= 0.85)" if "compiled" in name else ""))
    print(f"{CEILING} / {PEAK}: {spread(per_round(CEILING, PEAK))} (no step's 6N part runs faster)")
    raw = "llmstack compiled (raw loop)" if engine_compiled else "llmstack (raw loop)"
    overhead = [1 - x for x in per_round(DEFAULT, raw)]
    print(f"DeepSpeed engine overhead vs {raw}: {spread(overhead)} (target <= 0.05)")


if __name__ == "__main__":
    main()
