"""ONNX Runtime against PyTorch, and what int8 dynamic quantization costs and gains.

    python bench/bench_onnx.py [--new-tokens 128] [--train-steps 300]

Speed: greedy decoding with the KV cache, batch 1, of the 13.8M-parameter baseline model of
/work/shared/FACTS.md (random weights), in PyTorch (`generate`), onnxruntime fp32 and
onnxruntime int8; best of 3 runs, one CPU thread each. Perplexity: a small model (2 layers,
hidden 128, a 2k stdlib tokenizer; small enough to train on a shared 2-core CPU in minutes)
trained here for --train-steps steps on stdlib docstrings, scored on held-out docstrings in fp32
and int8 through onnxruntime.
"""

import argparse
import contextlib
import math
import sys
import tempfile
import time

import numpy as np
import torch
from timing import BASELINE_MODEL  # bench/timing.py

from llmstack import LLMStackConfig, LLMStackForCausalLM
from llmstack.inference import generate
from llmstack.inference.onnx_export import OnnxDecoder, export_onnx, quantize_int8


def best_time(decode, repeats=3):
    decode()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = decode()
        times.append(time.perf_counter() - start)
    return min(times), tokens


def speed(tmp: str, new_tokens: int) -> None:
    torch.manual_seed(0)
    config = LLMStackConfig(**BASELINE_MODEL, max_position_embeddings=1024, eos_token_id=None)
    model = LLMStackForCausalLM(config).eval()
    export_onnx(model, f"{tmp}/speed/model.onnx")
    quantize_int8(f"{tmp}/speed/model.onnx", f"{tmp}/speed/model.int8.onnx")
    prompt = torch.randint(0, config.vocab_size, (16,)).tolist()
    fp32, int8 = (OnnxDecoder(f"{tmp}/speed/{name}", threads=1) for name in ("model.onnx", "model.int8.onnx"))
    runs = {
        "pytorch": lambda: generate(model, [prompt], max_new_tokens=new_tokens)[0],
        "onnxruntime fp32": lambda: fp32.greedy(prompt, new_tokens),
        "onnxruntime int8": lambda: int8.greedy(prompt, new_tokens),
    }
    results = {name: best_time(run) for name, run in runs.items()}
    print(f"greedy decoding, batch 1, prompt 16, {new_tokens} new tokens, 13.8M parameters, 1 thread:")
    for name, (seconds, _) in results.items():
        print(f"  {name:18s} {new_tokens / seconds:7.1f} tokens/s  ({results['pytorch'][0] / seconds:.2f}x PyTorch)")
    print(
        f"  onnxruntime fp32 tokens == PyTorch tokens: {results['onnxruntime fp32'][1] == results['pytorch'][1]}; "
        f"int8 agrees on {sum(a == b for a, b in zip(results['onnxruntime int8'][1], results['pytorch'][1]))}"
        f"/{new_tokens} positions"
    )


def blocks(tokenizer, texts, seq_len):
    ids = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def onnx_perplexity(decoder: OnnxDecoder, data: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for row in data.numpy():
        logits, _ = decoder.forward(row[None, :-1], np.ones((1, len(row) - 1)), np.arange(len(row) - 1)[None])
        logits = torch.from_numpy(logits[0])
        nll += torch.nn.functional.cross_entropy(logits, torch.from_numpy(row[1:]), reduction="sum").item()
        count += len(row) - 1
    return math.exp(nll / count)


def perplexity(tmp: str, steps: int) -> None:
    from llmstack.data.stdlib_corpus import stdlib_docstrings
    from llmstack.data.tokenizer import train_tokenizer

    texts = stdlib_docstrings()
    tokenizer = train_tokenizer(texts, vocab_size=2048, out_dir=f"{tmp}/tok")
    train, valid = (
        blocks(tokenizer, texts[: -len(texts) // 20], 129),
        blocks(tokenizer, texts[-len(texts) // 20 :], 129),
    )
    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    model = LLMStackForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        batch = train[torch.randint(0, len(train), (8,))]
        loss = model(batch[:, :-1], shift_labels=batch[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    export_onnx(model, f"{tmp}/ppl/model.onnx")
    quantize_int8(f"{tmp}/ppl/model.onnx", f"{tmp}/ppl/model.int8.onnx")
    valid = valid[:64]
    fp32 = onnx_perplexity(OnnxDecoder(f"{tmp}/ppl/model.onnx", threads=1), valid)
    int8 = onnx_perplexity(OnnxDecoder(f"{tmp}/ppl/model.int8.onnx", threads=1), valid)
    print(
        f"perplexity on {valid.numel()} held-out stdlib docstring tokens, 2-layer model after {steps} steps "
        f"(final train loss {loss.item():.2f}): fp32 {fp32:.2f}, int8 {int8:.2f} ({(int8 / fp32 - 1) * 100:+.2f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(sys.stderr):
            import llmstack.data.stdlib_corpus  # noqa: F401  (anything it logs goes to stderr)
        speed(tmp, args.new_tokens)
        perplexity(tmp, args.train_steps)


if __name__ == "__main__":
    main()
