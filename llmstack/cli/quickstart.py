"""The embedded quickstart: raw text to a trained, exported model that generates, with no download.

    corpus -> cleaning pipeline (normalize, language ID, repetition filter, PII, exact + MinHash
    dedup) -> tokenizer -> packed shards -> DeepSpeed training (deepspeed launcher, N ranks)
    -> validation -> Hugging Face export (Llama format) -> generated sample

The default corpus is the Python standard library's docstrings; `--data`/`--valid` point the
same command at your own JSONL, Parquet or text files.
"""

import json
import os
import shutil
import subprocess
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Iterator, Sequence

from llmstack.errors import UserError
from llmstack.net import free_port

SAMPLE_PROMPTS = ["Return the", "This module provides", "If the"]


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument("--out", default="runs/quickstart", help="run directory (default: runs/quickstart)")
    p.add_argument("--data", nargs="+", help="training documents (default: the Python stdlib's docstrings)")
    p.add_argument("--valid", nargs="+", help="held-out documents (required with --data)")
    p.add_argument("--text-field", default="text", help="field holding the text in JSONL/Parquet files")
    p.add_argument("--config", default="configs/quickstart.yaml", help="run config (model and schedule)")
    p.add_argument("--ds-config", default="ds_configs/zero2.json", help="DeepSpeed JSON")
    p.add_argument("--num-ranks", type=int, default=2, help="processes for the deepspeed launcher (--num_gpus)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="run config overrides")


def run(args: Namespace) -> None:
    for path in (args.config, args.ds_config):
        if not os.path.isfile(path):
            raise UserError(f"{path} not found; run the quickstart from the repository root or pass its path")
    if args.data and not args.valid:
        raise UserError("--data needs --valid: held-out documents to measure the validation loss on")
    out = args.out
    os.makedirs(out, exist_ok=True)

    tokenizer_dir, shards = prepare_data(out, args.data, args.valid, args.text_field, args.vocab_size)

    step(f"5/7 train: deepspeed launcher, {args.num_ranks} ranks, {args.ds_config}")
    # A quickstart starts over: an earlier quickstart's metrics and checkpoints are replaced.
    metrics_path = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    # The deepspeed launcher of this interpreter, not whichever `deepspeed` is first on PATH.
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(args.num_ranks),
        "--master_port",
        str(free_port()),
        "--module",
        "llmstack",
        "train",
        "--config",
        args.config,
        "--ds-config",
        args.ds_config,
        f"data.tokenizer={tokenizer_dir}",
        f"data.train={shards['train']}",
        f"data.valid={shards['valid']}",
        f"train.out_dir={out}",
        *args.overrides,
    ]
    print(" ".join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        raise UserError("training failed (see the output above)")

    step("6/7 export to Hugging Face (Llama format)")
    from llmstack.training.export import export_hf

    hf_dir = os.path.join(out, "hf")
    export_hf(os.path.join(out, "checkpoints"), hf_dir, fmt="llama")
    print(f"{hf_dir}: loads with transformers.AutoModelForCausalLM.from_pretrained, no llmstack needed")

    step("7/7 sample")
    first, last = validation_losses(metrics_path)
    print(f"validation loss {first:.3f} -> {last:.3f} ({last / first:.0%} of its starting value)")
    for prompt, completion in zip(SAMPLE_PROMPTS, sample(hf_dir, SAMPLE_PROMPTS)):
        print(f"> {prompt}{completion}")


def prepare_data(
    out: str, data: Sequence[str] | None, valid: Sequence[str] | None, text_field: str = "text", vocab_size: int = 4096
) -> tuple[str, dict[str, str]]:
    """Steps 1-4 of the quickstart: corpus (the stdlib's docstrings unless `data`/`valid` are given),
    cleaning, tokenizer and packed shards under `out`. Returns (tokenizer dir, {"train", "valid"}:
    shard prefix)."""
    from llmstack.data.pack import pack_documents, read_documents
    from llmstack.data.stdlib_corpus import write_stdlib_corpus
    from llmstack.data.tokenizer import train_tokenizer

    step("1/7 corpus")
    if data:
        train_files, valid_files = list(data), list(valid or [])
    else:
        stats = write_stdlib_corpus(os.path.join(out, "corpus"))
        print(
            f"stdlib docstrings: {stats['train'][0]} train / {stats['valid'][0]} valid documents, "
            f"{(stats['train'][1] + stats['valid'][1]) / 1e6:.2f} MB"
        )
        train_files = [os.path.join(out, "corpus", "train.jsonl")]
        valid_files = [os.path.join(out, "corpus", "valid.jsonl")]

    step("2/7 clean")
    train_files = clean(train_files, text_field, os.path.join(out, "clean", "train"))
    valid_files = clean(valid_files, text_field, os.path.join(out, "clean", "valid"))

    def texts(files: Sequence[str]) -> Iterator[str]:
        return (row["text"] for row in read_documents(files))

    step("3/7 tokenizer")
    tokenizer_dir = os.path.join(out, "tokenizer")
    tokenizer = train_tokenizer(texts(train_files), vocab_size, tokenizer_dir)
    print(f"byte-level BPE, {len(tokenizer)} tokens -> {tokenizer_dir}")

    step("4/7 pack")
    shards = {}
    for split, files in (("train", train_files), ("valid", valid_files)):
        shards[split] = os.path.join(out, "data", split)
        docs, tokens = pack_documents(texts(files), tokenizer, shards[split])
        print(f"{split}: {docs} documents, {tokens} tokens -> {shards[split]}.bin/.idx")
    return tokenizer_dir, shards


def clean(files: Sequence[str], text_field: str, output: str) -> list[str]:
    """The cleaning pipeline with the quickstart's stages; returns the cleaned JSONL shards.

    The quality filters (Gopher, C4, FineWeb) are tuned for web pages and would drop most
    docstrings, so the quickstart runs the stages that suit any text; see
    configs/data_pipeline.yaml for the full set.
    """
    from llmstack.data.pipeline import cleaned_files, run_pipeline

    config = {
        "inputs": [{"paths": list(files), "text_field": text_field}],
        "output": output,
        "workers": 2,
        "stages": [
            "normalize",
            {"language": {"languages": ["en"], "threshold": 0.5}},
            "gopher_repetition",
            "pii",
        ],
        "dedup": {"exact": True, "near": True},
    }
    stats = run_pipeline(config)  # the whole job, report phase included: never None here
    assert stats is not None
    if not stats["dedup"].docs_out:
        raise UserError(
            f"the cleaning pipeline kept none of the documents of {', '.join(files)}; see {output}/report.json"
        )
    return cleaned_files(output)


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def validation_losses(metrics_path: str) -> tuple[float, float]:
    losses = []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "val_loss" in record:
                losses.append(record["val_loss"])
    if not losses:
        raise UserError(f"no validation loss in {metrics_path}")
    return losses[0], losses[-1]


def sample(model_dir: str, prompts: list[str], max_new_tokens: int = 48) -> list[str]:
    """Sampled continuations (one left-padded batch) from the exported model, loaded by stock
    transformers and decoded with llmstack's KV-cache generation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmstack.inference.generate import generate_text
    from llmstack.inference.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1)
    return generate_text(model, tokenizer, prompts, max_new_tokens=max_new_tokens, sampling=params, seed=0)
