"""Decoding speed: llmstack's KV-cache generation against full recomputation and against
transformers' `generate()` on the exported Llama model, same weights, same machine, one run.

    python bench/bench_generate.py [--new-tokens 256] [--device cpu|cuda]

Targets: cache / no cache >= 5x at 256 new tokens; llmstack / transformers >= 1.0x.
"""

import argparse
import time

import torch
from timing import BASELINE_MODEL  # bench/timing.py

from llmstack import LLMStackConfig, LLMStackForCausalLM, to_llama
from llmstack.inference import generate


def timed(decode):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = decode()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def best_tokens_per_s(decoders, new_tokens, repeats):
    """{name: (tokens/s, tokens)}: the best of `repeats` runs after a warm-up. The decoders take
    turns, so a load change on a shared machine hits them alike."""
    times, tokens = {}, {}
    for decode in decoders.values():
        decode()
    for _ in range(repeats):
        for name, decode in decoders.items():
            elapsed, tokens[name] = timed(decode)
            times[name] = min(times.get(name, float("inf")), elapsed)
    return {name: (new_tokens / times[name], tokens[name]) for name in decoders}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads; batch-1 decoding is latency-bound, and a shared CPU makes more threads spin",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = LLMStackConfig(**BASELINE_MODEL, max_position_embeddings=1024, eos_token_id=None)  # random weights
    model = LLMStackForCausalLM(config).to(args.device).eval()
    llama = to_llama(model).to(args.device).eval()
    llama.generation_config.eos_token_id = None
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device=args.device)
    n = args.new_tokens

    def ours(use_cache):
        return lambda: generate(model, prompt.tolist(), max_new_tokens=n, use_cache=use_cache)[0]

    def transformers_generate():
        with torch.inference_mode():
            out = llama.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return out[0, args.prompt_tokens :].tolist()

    (cached, cached_tokens), (hf, hf_tokens) = best_tokens_per_s(
        {"cache": ours(True), "transformers": transformers_generate}, n, args.repeats
    ).values()
    # Recomputation is slow; one run after the cache's warm-up is enough to measure it.
    elapsed, uncached_tokens = timed(ours(False))
    uncached = n / elapsed
    same = cached_tokens == uncached_tokens == hf_tokens and len(cached_tokens) == n

    print(
        f"device {args.device}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"batch 1, prompt {args.prompt_tokens}, {n} new tokens, greedy; identical tokens: {same}"
    )
    print(f"llmstack, KV cache             {cached:8.1f} tokens/s")
    print(f"llmstack, full recomputation   {uncached:8.1f} tokens/s")
    print(f"transformers generate (Llama)  {hf:8.1f} tokens/s")
    print(f"cache vs no cache:             {cached / uncached:6.2f}x  (target >= 5x)")
    print(f"llmstack vs transformers:      {cached / hf:6.2f}x  (target >= 1.0x)")


if __name__ == "__main__":
    main()
