"""Speculative decoding in the serving engine: greedy tokens per second with prompt lookup and with
a draft model, against plain decoding of the same requests in the same run, on text with
repetition (code followed by the start of an edited copy of it) and without (prose).

    python bench/bench_speculative.py [--model DIR] [--draft-model DIR] [--requests 4] [--max-tokens 64]
    python bench/bench_speculative.py --train-steps 300 [--requests 4] [--max-tokens 64]

Without --model it builds the 13.8M-parameter baseline model of /work/shared/FACTS.md with random
weights drawn with std 0.2 (with the default 0.02 its greedy output soon repeats one token, which
every proposer guesses) and a byte-level BPE tokenizer trained on the stdlib's docstrings; without
--draft-model, a random 2-layer, 128-wide draft with the same tokenizer. Random weights do not
continue text the way a trained model does, so their acceptance rates say little about a trained
pair's (random guesses are mostly rejected: the figures then show what speculation costs when it
fails); pass trained models to measure those, or `--train-steps N`: it first trains a 5.5M target
(256 wide, 4 layers) and a 1.5M draft (128 wide, 2 layers) for N AdamW steps each on 512-token
blocks of the stdlib (its docstrings and its source code, as many tokens of each), offline.
Requests run one at a time (batch 1, where speculation pays most); every request passes
ignore_eos and gets exactly --max-tokens tokens, and the outputs of every method are checked to
be the plain ones.
"""

import argparse
import contextlib
import random
import sys
import tempfile
import time

import torch
from bench_serve import baseline_model


def texts(kind: str, n: int, seed: int) -> list[str]:
    """n prompts of about 1500 characters: "repetitive" is a stdlib source excerpt, a comment
    and the excerpt's first lines again (an edit of the code about to be rewritten); "prose" is
    a run of stdlib docstrings."""
    from llmstack.data.stdlib_corpus import stdlib_docstrings, stdlib_source_files

    rng = random.Random(seed)
    if kind == "prose":
        docs = stdlib_docstrings()
        return [" ".join(rng.sample(docs, 8))[:1500] for _ in range(n)]
    sources = []
    for path in stdlib_source_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            if len(source := f.read()) > 4000:
                sources.append(source)
    prompts = []
    for source in rng.sample(sources, n):
        start = rng.randrange(0, len(source) - 1200)
        code = source[start : start + 1200]
        prompts.append(code + "\n\n# The same code, with the names changed:\n\n" + code[:300])
    return prompts


def train_pair(out_dir: str, steps: int, seed: int) -> tuple[str, str]:
    """(target, draft) directories: the two models trained for `steps` steps on the stdlib corpus,
    with the baseline model's tokenizer (trained on the docstrings)."""
    from transformers import AutoTokenizer

    from llmstack import LLMStackConfig, LLMStackForCausalLM
    from llmstack.data.stdlib_corpus import stdlib_docstrings, stdlib_source_files
    from llmstack.training.schedule import warmup_cosine
    from llmstack.training.trainer import param_groups

    baseline_model(out_dir)  # its tokenizer; the model files are overwritten below
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    docs = tokenizer(stdlib_docstrings())["input_ids"]
    budget = sum(map(len, docs))
    code: list[int] = []
    for path in stdlib_source_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            code += tokenizer(f.read())["input_ids"] + [tokenizer.eos_token_id]
        if len(code) >= budget:
            break
    ids = [t for doc in docs for t in doc + [tokenizer.eos_token_id]] + code
    blocks = torch.tensor(ids[: len(ids) // 513 * 513]).view(-1, 513)
    dirs = []
    for name, width, layers in (("target", 256, 4), ("draft", 128, 2)):
        config = LLMStackConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=3 * width,
            num_hidden_layers=layers,
            num_attention_heads=width // 64,
            max_position_embeddings=1024,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(seed)
        model = LLMStackForCausalLM(config).train()
        optimizer = torch.optim.AdamW(param_groups(model, 0.1, 2e-3), lr=2e-3, betas=(0.9, 0.95))
        schedule = warmup_cosine(optimizer, 2e-3, 2e-4, max(steps // 10, 1), steps)
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
        start = time.perf_counter()
        for step in range(steps):
            batch = blocks[order[(torch.arange(4) + 4 * step) % len(blocks)]]
            loss = model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
        print(
            f"trained the {name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M) for {steps} steps "
            f"of 4 x 512 tokens in {time.perf_counter() - start:.0f} s; last loss {loss.item():.2f}",
            file=sys.stderr,
        )
        path = f"{out_dir}/{name}"
        model.eval().save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from llmstack.inference.serve.engine import GenerationRequest

    outputs: list[list[int]] = []
    start = time.perf_counter()
    for prompt in prompts:
        tokens: list[int] = []
        engine.submit(
            GenerationRequest(prompt, max_tokens, ignore_eos=True, on_event=lambda e, t=tokens: t.extend(e.token_ids))
        )
        while engine.waiting or engine.running:
            engine.step()
        outputs.append(tokens)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the random baseline model)")
    parser.add_argument("--draft-model", help="draft model directory, same tokenizer (default: a random small one)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; more spin on a shared CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-steps", type=int, default=0, help="train a target and a draft for this many steps first (offline)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmstack import LLMStackConfig, LLMStackForCausalLM
    from llmstack.inference.serve.server import build_engine
    from llmstack.inference.speculative import SpeculativeConfig

    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the report only
            if args.train_steps:
                args.model, args.draft_model = train_pair(tmp, args.train_steps, args.seed)
            model_dir = args.model or baseline_model(tmp, initializer_range=0.2)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        if args.draft_model:  # read while a trained pair's directory exists
            draft = AutoModelForCausalLM.from_pretrained(args.draft_model).eval()
    if not args.draft_model:
        torch.manual_seed(1)
        draft = LLMStackForCausalLM(
            LLMStackConfig(
                vocab_size=model.config.vocab_size,
                hidden_size=128,
                initializer_range=0.2,
                intermediate_size=384,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=model.config.max_position_embeddings,
            )
        ).eval()
    methods = {
        "plain": {},
        "ngram": {"speculative": SpeculativeConfig("ngram", args.speculative_tokens)},
        "draft": {"speculative": SpeculativeConfig("draft", args.speculative_tokens), "draft": draft},
    }
    print(
        f"{args.requests} requests one at a time, {args.max_tokens} greedy tokens each, "
        f"{args.speculative_tokens} guesses per step, torch threads {args.threads}"
    )
    for kind in ("repetitive", "prose"):
        prompts = [tokenizer(t)["input_ids"] for t in texts(kind, args.requests, args.seed)]
        mean_prompt = sum(map(len, prompts)) / len(prompts)
        baseline, reference = None, None
        for name, options in methods.items():
            engine = build_engine(model, tokenizer, kv_cache_mb=64, max_running=1, **options)
            run(engine, prompts[:1], args.max_tokens)  # warm-up
            engine.metrics = type(engine.metrics)()  # count the measured requests only
            elapsed, outputs = run(engine, prompts, args.max_tokens)
            rate = args.requests * args.max_tokens / elapsed
            if baseline is None:
                baseline, reference = rate, outputs
                extra = ""
            else:
                value = engine.metrics.registry.get_sample_value
                guessed = value("llmstack_speculative_draft_tokens_total") or 0.0
                kept = value("llmstack_speculative_accepted_tokens_total") or 0.0
                extra = (
                    f", acceptance {kept / max(guessed, 1):.2f} ({kept:.0f}/{guessed:.0f} guesses), "
                    f"speedup {rate / baseline:.2f}x, same tokens as plain: {outputs == reference}"
                )
            print(f"{kind} (prompts {mean_prompt:.0f} tokens) {name}: {rate:.1f} tokens/s{extra}")


if __name__ == "__main__":
    main()
