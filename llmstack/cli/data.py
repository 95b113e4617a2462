"""`llmstack data`: clean a corpus, train a tokenizer, pack token shards."""


def add_arguments(p):
    sub = p.add_subparsers(dest="data_command", metavar="STEP", required=True)
    clean = sub.add_parser("clean", help="normalize, filter, mask PII and deduplicate documents (one YAML config)")
    clean.add_argument("--config", required=True, help="pipeline config (see configs/data_pipeline.yaml)")
    clean.add_argument("--output", help="output directory (overrides the config's `output`)")
    clean.add_argument("--workers", type=int, help="worker processes (overrides the config's `workers`)")

    tok = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on documents")
    tok.add_argument("--data", required=True, nargs="+", help="JSONL/Parquet/text files or globs")
    tok.add_argument("--out", required=True, help="tokenizer directory to write")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument("--min-frequency", type=int, default=2)
    tok.add_argument("--text-field", default="text")

    pack = sub.add_parser("pack", help="tokenize documents and write a Megatron .bin/.idx dataset")
    pack.add_argument("--data", required=True, nargs="+", help="JSONL/Parquet/text files or globs (e.g. clean/*.jsonl)")
    pack.add_argument("--tokenizer", required=True, help="tokenizer directory")
    pack.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    pack.add_argument("--text-field", default="text")


def run(args):
    if args.data_command == "clean":
        from llmstack.data.pipeline import run_pipeline

        overrides = {"output": args.output, "workers": args.workers}
        run_pipeline(args.config, {k: v for k, v in overrides.items() if v is not None})
        return 0

    from llmstack.data.pack import pack_documents, read_documents
    from llmstack.data.tokenizer import load_tokenizer, train_tokenizer

    texts = (row["text"] for row in read_documents(args.data, args.text_field))
    if args.data_command == "train-tokenizer":
        tokenizer = train_tokenizer(texts, args.vocab_size, args.out, min_frequency=args.min_frequency)
        print(f"byte-level BPE with {len(tokenizer)} tokens -> {args.out}")
    else:
        docs, tokens = pack_documents(texts, load_tokenizer(args.tokenizer), args.out)
        print(f"{docs} documents, {tokens} tokens -> {args.out}.bin/.idx")
    return 0
