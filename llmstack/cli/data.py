"""`llmstack data`: clean a corpus, decontaminate it, train a tokenizer, pack token shards."""

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

    dec = sub.add_parser(
        "decontaminate",
        help="drop (or cut) documents sharing word n-grams with evaluation sets",
        description="Drop the documents that share a word n-gram (13 words by default; characters of Chinese, "
        "Japanese and other unsegmented scripts count as words) with any example of the evaluation sets, or "
        "with --mode cut remove the matched spans. Runs as a `data clean` job with this one stage: shards in "
        "worker processes, OUT/clean/shard-*.jsonl, OUT/report.json with the counts per evaluation set.",
    )
    dec.add_argument("--data", required=True, nargs="+", help="training documents: JSONL, Parquet, .txt files or globs")
    dec.add_argument(
        "--eval",
        required=True,
        nargs="+",
        metavar="NAME=PATHS",
        help="evaluation sets, each a name and a file or glob (JSONL, Parquet, .txt): mmlu=evals/mmlu/*.jsonl",
    )
    dec.add_argument("--out", required=True, help="output directory")
    dec.add_argument("--ngram", type=int, default=13, help="n-gram length in words (default 13, as GPT-3)")
    dec.add_argument("--mode", choices=("drop", "cut"), default="drop")
    dec.add_argument("--text-field", default="text", help="text field of the training documents")
    dec.add_argument("--eval-text-field", default="text", help="text field of the evaluation examples")
    dec.add_argument("--eval-text-unit", choices=TEXT_UNITS, default="line", help="an example of a .txt eval file")
    dec.add_argument("--workers", type=int, default=1)
    dec.add_argument("--index-dir", help="where the n-gram index is kept (default ~/.cache/llmstack/decontaminate)")

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
    tok.add_argument(
        "--sentinels",
        type=int,
        default=0,
        metavar="N",
        help="add N sentinel tokens <extra_id_0>... for span corruption (train.objective: span_corruption; "
        "T5 uses 100; blocks of seq_len tokens need about seq_len / 20)",
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
        help="target share of the trained tokens of each --data pattern (a source): prints the "
        "data.train mixture to train on and each source's share of the packed tokens against it, "
        "warning, naming the source, when it is more than 20%% off",
    )
    pack.add_argument("--names", nargs="+", help="a name for each --data pattern (default: the patterns)")


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
    if args.data_command == "decontaminate":
        return decontaminate(args)

    from llmstack.data.mixture import format_shares, source_names, unbalanced
    from llmstack.data.pack import mixture_sources, pack_files, pack_token_shares
    from llmstack.data.reader import iter_documents
    from llmstack.data.tokenizer import train_tokenizer

    if args.data_command == "train-tokenizer":
        texts = (doc.text for doc in iter_documents(args.data, args.text_field, args.text_unit))
        tokenizer = train_tokenizer(
            texts,
            args.vocab_size,
            args.out,
            min_frequency=args.min_frequency,
            encoder_tokens=args.encoder_tokens,
            sentinels=args.sentinels,
        )
        print(f"byte-level BPE with {len(tokenizer)} tokens -> {args.out}")
    else:
        if args.weights and len(args.weights) != len(args.data):
            raise UserError(
                f"give one --weights value per --data pattern: {len(args.data)} patterns, {len(args.weights)} weights"
            )
        if args.names and (not args.weights or len(args.names) != len(args.data)):
            raise UserError(f"--names needs --weights and one name per --data pattern ({len(args.data)})")
        if args.names:
            source_names([{"name": n, "paths": p} for n, p in zip(args.names, args.data)], "paths", (), "--names")
        shards, docs, tokens = pack_files(
            args.data, args.tokenizer, args.out, args.text_field, args.workers, args.text_unit
        )
        train: list = shards
        if args.weights:
            shares = pack_token_shares(args.data, shards, args.weights, args.names)
            print(format_shares(shares), file=sys.stderr)
            unbalanced(shares)
            train = mixture_sources(args.data, shards, args.weights, args.names)
        print(f"{docs} documents, {tokens} tokens in {len(shards)} shards; train on them with the override")
        print(shlex.quote(f"data.train={json.dumps(train)}"))
    return 0


def eval_set_specs(items: list[str], text_field: str, text_unit: str) -> list[dict]:
    """--eval NAME=PATHS items as the decontaminate stage's eval_sets."""
    specs = []
    for item in items:
        name, sep, paths = item.partition("=")
        if not sep or not name or not paths:
            raise UserError(f"--eval takes NAME=PATHS (e.g. mmlu=evals/mmlu.jsonl); got {item!r}")
        specs.append({"name": name, "paths": paths, "text_field": text_field, "text_unit": text_unit})
    return specs


def decontaminate(args: argparse.Namespace) -> int:
    from llmstack.data.pipeline import run_pipeline

    stage = {
        "eval_sets": eval_set_specs(args.eval, args.eval_text_field, args.eval_text_unit),
        "ngram": args.ngram,
        "mode": args.mode,
    }
    if args.index_dir:
        stage["index_dir"] = args.index_dir
    config = {
        "inputs": [{"paths": args.data, "text_field": args.text_field}],
        "output": args.out,
        "workers": args.workers,
        "stages": [{"decontaminate": stage}],
    }
    stats = run_pipeline(config)
    assert stats is not None  # a one-task job runs the report phase
    counts = stats["decontaminate"].counts
    for spec in stage["eval_sets"]:
        name = spec["name"]
        print(
            f"{name}: {counts[f'contaminated:{name}']} documents share {args.ngram}-grams with it "
            f"({counts[f'ngrams:{name}']} n-gram occurrences)"
        )
    return 0
