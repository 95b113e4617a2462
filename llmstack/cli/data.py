"""`llmstack data`: clean a corpus, train a tokenizer, pack token shards."""

import argparse
import json
import shlex
import sys

from llmstack.data.reader import TEXT_UNITS  # light: no datasets, torch or tokenizers
from llmstack.errors import UserError

TEXT_UNIT_HELP = "what a document of a .txt file is: the whole file (default), a paragraph or a line"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="STEP", required=True)
    clean = sub.add_parser("clean", help="normalize, filter, mask PII and deduplicate documents (one YAML config)")
    clean.add_argument("--config", required=True, help="pipeline config (see configs/data_pipeline.yaml)")
    clean.add_argument("--output", help="output directory (overrides the config's `output`)")
    clean.add_argument("--workers", type=int, help="worker processes (overrides the config's `workers`)")
    clean.add_argument("--task", type=int, default=0, help="this task's index, 0..N-1, in a multi-task job")
    clean.add_argument(
        "--num-tasks",
        type=int,
        default=1,
        help="tasks of the job (e.g. a SLURM array); task I filters and writes shards I, I+N, ... "
        "and merges key range I of N for global dedup (see launch/data_clean.sbatch)",
    )
    clean.add_argument(
        "--phase",
        default="all",
        choices=("all", "filter", "merge", "cluster", "write", "report"),
        help="the phase to run: all (one-task jobs) or, in a multi-task job, one phase at a time "
        "in this order, each on every task (cluster and report on one)",
    )

    tok = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on documents")
    tok.add_argument(
        "--data", required=True, nargs="+", help="JSONL (.gz/.zst too), Parquet, .txt files, saved datasets, or globs"
    )
    tok.add_argument("--out", required=True, help="tokenizer directory to write")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument("--min-frequency", type=int, default=2)
    tok.add_argument(
        "--encoder-tokens",
        action="store_true",
        help="add the mask token a masked-LM encoder (train.objective: mlm) needs",
    )
    tok.add_argument("--text-field", default="text")
    tok.add_argument("--text-unit", choices=TEXT_UNITS, default="document", help=TEXT_UNIT_HELP)

    pack = sub.add_parser(
        "pack",
        help="tokenize documents into Megatron .bin/.idx shards, one per data file",
        description="Tokenize documents into Megatron .bin/.idx shards PREFIX-00000, PREFIX-00001, ..., one per "
        "non-empty data file, in worker processes. A rerun keeps finished shards and packs the rest. It prints "
        "the shard prefixes as a run config override to train on them: data.train=[...] on the `llmstack train` "
        "command line, or the same list under data.train in the run config.",
    )
    pack.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="JSONL (.gz/.zst too), Parquet, .txt files or globs (e.g. clean/clean/*.jsonl)",
    )
    pack.add_argument("--tokenizer", required=True, help="tokenizer directory")
    pack.add_argument("--out", required=True, help="output prefix: writes PREFIX-00000.bin/.idx, ...")
    pack.add_argument("--text-field", default="text")
    pack.add_argument("--text-unit", choices=TEXT_UNITS, default="document", help=TEXT_UNIT_HELP)
    pack.add_argument("--workers", type=int, default=1, help="worker processes, each packing one file at a time")
    pack.add_argument(
        "--weights",
        type=float,
        nargs="+",
        help="target share of each --data pattern (a source): prints each source's share of the "
        "tokens against it and warns, naming the source, when it is more than 20%% off",
    )


def run(args: argparse.Namespace) -> int:
    if args.data_command == "clean":
        from llmstack.data.pipeline import run_pipeline

        overrides = {"output": args.output, "workers": args.workers}
        run_pipeline(
            args.config,
            {k: v for k, v in overrides.items() if v is not None},
            task=args.task,
            num_tasks=args.num_tasks,
            phase=args.phase,
        )
        return 0

    from llmstack.data.mixture import format_shares, unbalanced
    from llmstack.data.pack import pack_files, pack_token_shares
    from llmstack.data.reader import iter_documents
    from llmstack.data.tokenizer import train_tokenizer

    if args.data_command == "train-tokenizer":
        texts = (doc.text for doc in iter_documents(args.data, args.text_field, args.text_unit))
        tokenizer = train_tokenizer(
            texts, args.vocab_size, args.out, min_frequency=args.min_frequency, encoder_tokens=args.encoder_tokens
        )
        print(f"byte-level BPE with {len(tokenizer)} tokens -> {args.out}")
    else:
        if args.weights and len(args.weights) != len(args.data):
            raise UserError(
                f"give one --weights value per --data pattern: {len(args.data)} patterns, {len(args.weights)} weights"
            )
        shards, docs, tokens = pack_files(
            args.data, args.tokenizer, args.out, args.text_field, args.workers, args.text_unit
        )
        if args.weights:
            shares = pack_token_shares(args.data, shards, args.weights)
            print(format_shares(shares), file=sys.stderr)
            unbalanced(shares)
        print(f"{docs} documents, {tokens} tokens in {len(shards)} shards; train on them with the override")
        print(shlex.quote(f"data.train={json.dumps(shards)}"))
    return 0
