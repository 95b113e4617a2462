"""Load test of `llmstack serve` through the official openai client: 64 requests (prompts of
16-512 tokens, max_tokens 16-256, half of them streamed) from 16 concurrent clients, against
the same requests sent one at a time to the same server.

    python bench/bench_serve.py [--model DIR] [--requests 64] [--concurrency 16]

Without --model it serves the 13.8M-parameter baseline model of /work/shared/FACTS.md with random
weights and a byte-level BPE tokenizer trained on the stdlib's docstrings. Every request passes
`ignore_eos` (vLLM's extension), so each must return exactly its max_tokens tokens.
Target: concurrent / one at a time >= 3x in generated tokens per second.

    python bench/bench_serve.py --shared-prefix 1024 [--requests 64] [--prefix-cache-mb 128]

instead sends 64 streamed requests whose prompts are one shared 1024-token "system prompt" and a
user part of their own (16-64 tokens; max_tokens 8-32) to a server without prefix caching, then
to one with it (the same requests, each server warmed up with other prompts), and prints the
ratio of their times to first token. Target: TTFT p50 with caching <= 0.3x without.

    python bench/bench_serve.py --long-prompt 4096 [--concurrency 16] [--chunk-sizes 0,512,32,16] [--rounds 2]

instead keeps `--concurrency` streamed requests decoding (prompts of 128-256 tokens) and then sends
one prompt of 4096 tokens, against one server per `--chunked-prefill-size` (0: unchunked), all
started together and measured in turn, round after round. For each it prints the inter-token
latency p99 of the running requests before the long prompt arrives (the baseline) and while it is
prefilled (gaps that overlap its submission to its first token), and their ratio. Target: chunked
ITL p99 during the arrival <= 2x the baseline.

    python bench/bench_serve.py --step-cost [--long-prompt 4096] [--concurrency 16]

instead times, in the engine thread's CPU time (`time.thread_time`, which other processes' load
inflates much less than wall time), one forward of `--concurrency` decode rows (128-256 cached
tokens) alone, and with a chunk of 16, 32 or 512 prompt tokens at positions near the start and the
end of a `--long-prompt` prompt, as separate forwards (chunk, then decode) and packed in one: the
ratios to the decode forward bound the inter-token latency ratio on an idle machine.
"""

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    max_tokens: int
    stream: bool
    completion_tokens: int = 0
    ttft: float | None = None  # seconds to the first streamed text
    gaps: list[float] = field(default_factory=list)  # seconds between streamed chunks


def baseline_model(out_dir: str, initializer_range: float = 0.02, max_position_embeddings: int = 1024) -> str:
    import torch

    from llmstack import LLMStackConfig, LLMStackForCausalLM
    from llmstack.data.stdlib_corpus import stdlib_docstrings
    from llmstack.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(stdlib_docstrings(), vocab_size=8192, out_dir=out_dir)
    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=len(tokenizer),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=initializer_range,
    )
    LLMStackForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int, bool]]:
    """(prompt token ids, max_tokens, stream) for each request."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(2, vocab) for _ in range(rng.randint(16, 512))], rng.randint(16, 256), i % 2 == 0)
        for i in range(n)
    ]


def shared_prefix_workload(n: int, vocab: int, prefix: int, seed: int) -> list[tuple[list[int], int, bool]]:
    """One shared `prefix`-token system prompt, then each request's own 16-64 tokens; all streamed."""
    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(prefix)]
    return [
        (system + [rng.randrange(2, vocab) for _ in range(rng.randint(16, 64))], rng.randint(8, 32), True)
        for _ in range(n)
    ]


async def send(client, model: str, prompt: list[int], max_tokens: int, stream: bool) -> Outcome:
    outcome = Outcome(max_tokens, stream)
    options = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        response = await client.completions.create(**options)
        outcome.completion_tokens = response.usage.completion_tokens
        return outcome
    start = last = time.perf_counter()
    async for chunk in await client.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        now = time.perf_counter()
        if chunk.usage is not None:
            outcome.completion_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            if outcome.ttft is None:
                outcome.ttft = now - start
            else:
                outcome.gaps.append(now - last)
            last = now
    return outcome


async def run_load(base_url: str, model: str, requests, concurrency: int) -> tuple[float, list[Outcome]]:
    """Wall time and outcomes of `requests` sent by `concurrency` clients, each taking the next."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=3600, max_retries=0)
    queue = list(enumerate(requests))
    outcomes: list[Outcome | None] = [None] * len(requests)

    async def worker():
        while queue:
            i, (prompt, max_tokens, stream) = queue.pop(0)
            outcomes[i] = await send(client, model, prompt, max_tokens, stream)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await client.close()
    return elapsed, outcomes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(label: str, elapsed: float, outcomes: list[Outcome]) -> float:
    tokens = sum(o.completion_tokens for o in outcomes)
    exact = sum(o.completion_tokens == o.max_tokens for o in outcomes)
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    gaps = [g for o in outcomes for g in o.gaps]
    print(
        f"{label}: {len(outcomes)} requests, {exact} with exactly max_tokens tokens, {tokens} tokens in "
        f"{elapsed:.1f} s = {tokens / elapsed:.1f} tokens/s; streamed: TTFT p50 {percentile(ttfts, 50):.3f} s "
        f"p99 {percentile(ttfts, 99):.3f} s, inter-token p50 {percentile(gaps, 50) * 1e3:.1f} ms "
        f"p99 {percentile(gaps, 99) * 1e3:.1f} ms"
    )
    return tokens / elapsed


def start_server(
    model_dir: str, port: int, args, prefix_cache_mb: float = 0, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "llmstack",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--kv-cache-mb",
        str(args.kv_cache_mb),
        "--max-running",
        str(args.concurrency),
        "--threads",
        str(args.threads),
        "--prefix-cache-mb",
        str(prefix_cache_mb),
        *extra,
    ]
    server = subprocess.Popen(command, stdout=sys.stderr)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not start within 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory to serve (default: the random baseline model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--kv-cache-mb", type=float, help="default 512; 640 with --shared-prefix (16 slots of 2048 tokens)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the server's torch threads; on a shared CPU more threads spin and slow every step",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="prompts share a system prompt of this many tokens: compare TTFT without and with prefix caching",
    )
    parser.add_argument("--prefix-cache-mb", type=float, default=128, help="the prefix cache of --shared-prefix")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        metavar="TOKENS",
        help="a prompt this long arrives while the others decode: compare their inter-token latency "
        "with and without chunked prefill",
    )
    parser.add_argument(
        "--chunk-sizes", default="0,512,32,16", help="--chunked-prefill-size of each server of --long-prompt (0: off)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each server of --long-prompt")
    parser.add_argument(
        "--step-cost", action="store_true", help="CPU time of a step's forward with and without a chunk"
    )
    args = parser.parse_args()
    if args.kv_cache_mb is None:
        args.kv_cache_mb = 640 if args.shared_prefix else 512

    from llmstack.net import free_port

    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the report only
            context = 1024 if not args.shared_prefix else max(1024, 2 ** (args.shared_prefix + 96).bit_length())
            if args.step_cost:
                args.long_prompt = args.long_prompt or 4096
            if args.long_prompt:
                context = args.long_prompt + 512
            model_dir = args.model or baseline_model(tmp, max_position_embeddings=context)
        from transformers import AutoTokenizer

        if args.shared_prefix:
            shared_prefix(model_dir, args)
            return
        if args.step_cost:
            step_cost(model_dir, args)
            return
        if args.long_prompt:
            long_prompt(model_dir, args)
            return

        requests = workload(args.requests, len(AutoTokenizer.from_pretrained(model_dir)), args.seed)
        port = free_port()
        server = start_server(model_dir, port, args)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            asyncio.run(run_load(url, "bench", requests[:2], 1))  # warm-up
            concurrent = report(
                f"{args.concurrency} concurrent clients",
                *asyncio.run(run_load(url, "bench", requests, args.concurrency)),
            )
            alone = report("one at a time", *asyncio.run(run_load(url, "bench", requests, 1)))
        finally:
            server.terminate()
            server.wait()
    print(
        f"throughput, concurrent / one at a time: {concurrent / alone:.2f}x (target >= 3x); "
        f"{os.cpu_count()} CPUs, server torch threads {args.threads}"
    )


def shared_prefix(model_dir: str, args) -> None:
    from transformers import AutoTokenizer

    from llmstack.net import free_port

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    requests = shared_prefix_workload(args.requests, vocab, args.shared_prefix, args.seed)
    warmup = workload(2, vocab, args.seed + 1)  # other prompts: the cached server starts cold
    p50 = {}
    for label, budget in (
        ("without prefix caching", 0),
        (f"prefix cache {args.prefix_cache_mb:g} MiB", args.prefix_cache_mb),
    ):
        port = free_port()
        server = start_server(model_dir, port, args, prefix_cache_mb=budget)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            asyncio.run(run_load(url, "bench", [(p, 4, s) for p, _, s in warmup], 1))
            elapsed, outcomes = asyncio.run(run_load(url, "bench", requests, args.concurrency))
            report(f"{label}, {args.concurrency} concurrent clients", elapsed, outcomes)
            p50[budget] = percentile([o.ttft for o in outcomes if o.ttft is not None], 50)
            if budget:
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
                values = {
                    line.split()[0]: float(line.split()[1])
                    for line in metrics.splitlines()
                    if line.startswith("llmstack_prefix_cache_")
                }
                hit, query = (
                    values["llmstack_prefix_cache_hit_tokens_total"],
                    values["llmstack_prefix_cache_query_tokens_total"],
                )
                print(
                    f"prefix cache hit rate (from /metrics, warm-up included): {hit:.0f} / {query:.0f} "
                    f"prompt tokens = {hit / query:.1%}"
                )
        finally:
            server.terminate()
            server.wait()
    print(
        f"TTFT p50 with / without prefix caching: {p50[args.prefix_cache_mb]:.3f} s / {p50[0]:.3f} s = "
        f"{p50[args.prefix_cache_mb] / p50[0]:.2f}x (target <= 0.3x); {args.requests} requests sharing "
        f"{args.shared_prefix} tokens; {os.cpu_count()} CPUs, server torch threads {args.threads}"
    )


async def stream_until(client, prompt: list[int], done: asyncio.Event, arrivals: list[float]) -> None:
    """Stream a long completion, noting when each text chunk arrives, until `done` is set."""
    options = dict(model="bench", prompt=prompt, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    async for chunk in await client.completions.create(**options, stream=True):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if done.is_set():
            break


async def long_prompt_trial(base_url: str, running: list[list[int]], long: list[int]) -> dict:
    """Gaps between the running requests' tokens before the long prompt arrives and while it is
    prefilled (from its submission to its first token), and its time to first token."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=3600, max_retries=0)
    done = asyncio.Event()
    arrivals: list[list[float]] = [[] for _ in running]
    tasks = [asyncio.create_task(stream_until(client, p, done, a)) for p, a in zip(running, arrivals)]
    while min(len(a) for a in arrivals) < 5:  # every request admitted and decoding
        await asyncio.sleep(0.05)
    base_start = time.perf_counter()
    await asyncio.sleep(2.0)
    sent = time.perf_counter()
    await client.completions.create(model="bench", prompt=long, max_tokens=1, temperature=0)
    first = time.perf_counter()
    done.set()
    await asyncio.gather(*tasks)
    await client.close()
    gaps = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    return {
        "baseline": [b - a for a, b in gaps if a >= base_start and b <= sent],
        "arrival": [b - a for a, b in gaps if b > sent and a < first],
        "ttft": first - sent,
    }


def long_prompt(model_dir: str, args) -> None:
    from transformers import AutoTokenizer

    from llmstack.inference.serve.kv_cache import CacheShape
    from llmstack.net import free_port
    from llmstack.training.loading import load_model_and_tokenizer

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    model, _ = load_model_and_tokenizer(model_dir, "cpu", causal=True)
    slot = CacheShape.of(model).bytes_per_token() * model.config.max_position_embeddings
    args.kv_cache_mb = (args.concurrency + 1) * slot / 2**20 + 1  # a slot for each, and the long prompt's
    del model
    rng = random.Random(args.seed)
    running = [[rng.randrange(2, vocab) for _ in range(rng.randint(128, 256))] for _ in range(args.concurrency)]
    long = [rng.randrange(2, vocab) for _ in range(args.long_prompt)]
    sizes = [int(s) for s in args.chunk_sizes.split(",")]
    servers, urls = [], {}
    try:
        for size in sizes:
            port = free_port()
            extra = ("--chunked-prefill-size", str(size), "--max-running", str(args.concurrency + 1))
            servers.append(start_server(model_dir, port, args, extra=extra))
            urls[size] = f"http://127.0.0.1:{port}/v1"
            asyncio.run(run_load(urls[size], "bench", [(running[0], 4, True)], 1))  # warm-up
        results: dict[int, dict[str, list[float]]] = {s: {"baseline": [], "arrival": [], "ttft": []} for s in sizes}
        for _ in range(args.rounds):  # interleaved: each server in turn, round after round
            for size in sizes:
                trial = asyncio.run(long_prompt_trial(urls[size], running, long))
                results[size]["baseline"] += trial["baseline"]
                results[size]["arrival"] += trial["arrival"]
                results[size]["ttft"].append(trial["ttft"])
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    for size in sizes:
        r = results[size]
        base, arrival = percentile(r["baseline"], 99), percentile(r["arrival"], 99)
        label = "unchunked" if size == 0 else f"--chunked-prefill-size {size}"
        print(
            f"{label}: running requests' ITL p99 {base * 1e3:.1f} ms before the {args.long_prompt}-token prompt, "
            f"{arrival * 1e3:.1f} ms during its prefill = {arrival / base:.2f}x (target <= 2x for chunked); "
            f"ITL p50 {percentile(r['baseline'], 50) * 1e3:.1f} / {percentile(r['arrival'], 50) * 1e3:.1f} ms; "
            f"its TTFT {', '.join(f'{t:.2f}' for t in r['ttft'])} s; {len(r['arrival'])} gaps during"
        )
    print(
        f"{args.concurrency} running requests, {args.rounds} rounds; {os.cpu_count()} CPUs, "
        f"server torch threads {args.threads}"
    )


def step_cost(model_dir: str, args) -> None:
    import statistics

    import torch

    from llmstack.inference.serve.kv_cache import CacheShape, CacheView, PackedView, SlotKVCache
    from llmstack.training.loading import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, _ = load_model_and_tokenizer(model_dir, "cpu", causal=True)
    n, vocab = args.concurrency, model.config.vocab_size
    cache = SlotKVCache(CacheShape.of(model), n + 1, model.config.max_position_embeddings)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(128, 257, (n,), generator=gen)
    rows = torch.randint(2, vocab, (n, 1), generator=gen)

    @torch.inference_mode()
    def forward(chunk: int, start: int, packed: bool) -> None:
        ids = torch.randint(2, vocab, (1, chunk), generator=gen)
        prefill = CacheView(cache, slot=n, start=start)
        decode = CacheView(cache, lengths=lengths, new_tokens=1)
        if not packed:
            if chunk:
                model(ids, position_ids=torch.arange(start, start + chunk)[None], cache=prefill, logits_to_keep=1)
            mask, positions = decode.attention_mask(), lengths[:, None]
            model(rows, attention_mask=mask, position_ids=positions, cache=decode, logits_to_keep=1)
            return
        view = PackedView([(prefill, chunk)], decode)
        positions = torch.cat([torch.arange(start, start + chunk), lengths])[None]
        model(
            torch.cat([ids, rows.T], 1),
            position_ids=positions,
            cache=view,
            logits_to_keep=torch.arange(chunk - 1, chunk + n),
        )

    def cpu_ms(chunk: int, start: int, packed: bool, repeats: int = 15) -> float:
        forward(chunk, start, packed)  # warm-up
        times = []
        for _ in range(repeats):
            begin = time.thread_time()
            forward(chunk, start, packed)
            times.append(time.thread_time() - begin)
        return statistics.median(times) * 1e3

    decode = cpu_ms(0, 0, False)
    print(f"{n} decode rows alone: {decode:.1f} ms CPU (median of 15); torch threads {args.threads}")
    for chunk in (16, 32, 512):
        for start in (512, args.long_prompt - chunk):
            separate, packed = cpu_ms(chunk, start, False), cpu_ms(chunk, start, True)
            print(
                f"chunk {chunk} at position {start}: separate forwards {separate:.1f} ms = {separate / decode:.2f}x "
                f"the decode forward, packed {packed:.1f} ms = {packed / decode:.2f}x"
            )


if __name__ == "__main__":
    main()
