"""What `train.compile: auto` weighs: the first step's compilation against the time compiled steps
save, for bench_train.py's model and the quickstart's, with an empty compile cache (a first run).

Prints, per model, the compile time (first compiled step minus a steady one), the eager and the
compiled step (fastest of --steps, taking turns), and the break-even: the steps after which
compiling has paid, compared with llmstack.training.compile.AUTO_MIN_STEPS.

    python bench/bench_compile.py [--steps 6]
"""

import argparse
import os
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")  # before torch loads

import torch  # noqa: E402
from timing import BASELINE_MODEL  # noqa: E402  # bench/timing.py

from llmstack import LLMStackConfig, LLMStackForCausalLM  # noqa: E402
from llmstack.training.compile import AUTO_MIN_STEPS, compile_decoder_layers  # noqa: E402

MODELS = {
    "bench_train (13.8M, batch 8 x 256)": (BASELINE_MODEL, 8, 256),
    "quickstart (4M, batch 8 x 256)": (
        dict(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        8,
        256,
    ),
}


def step(model, opt, batch):
    model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(model, opt, batch):
    start = time.perf_counter()
    step(model, opt, batch)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    for name, (shape, batch_size, seq) in MODELS.items():
        torch.manual_seed(0)
        config = LLMStackConfig(**shape)
        eager, compiled = LLMStackForCausalLM(config).train(), LLMStackForCausalLM(config).train()
        compile_decoder_layers(compiled)
        opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (eager, compiled)}
        batch = torch.randint(0, config.vocab_size, (batch_size, seq + 1))
        first = timed(compiled, opts[compiled], batch)
        timed(eager, opts[eager], batch)  # warm-up
        times = {eager: [], compiled: []}
        for _ in range(args.steps):
            for model in times:
                times[model].append(timed(model, opts[model], batch))
        eager_s, compiled_s = min(times[eager]), min(times[compiled])
        compile_s = first - compiled_s
        saved = eager_s - compiled_s
        even = f"{compile_s / saved:.0f} steps" if saved > 0 else "never (compiled is not faster)"
        print(
            f"{name}: compile {compile_s:.1f} s, eager step {eager_s:.3f} s, compiled step {compiled_s:.3f} s "
            f"({eager_s / compiled_s:.2f}x), break-even after {even} (auto compiles from {AUTO_MIN_STEPS})",
            flush=True,
        )


if __name__ == "__main__":
    main()
