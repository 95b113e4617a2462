from argparse import ArgumentParser, Namespace

from llmstack.training.export import FORMATS, export_hf


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", help="training checkpoint directory (OUT_DIR/checkpoints[/global_stepN]) or model directory"
    )
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="llmstack",
        help="llama, mistral, qwen2 (decoders), eurobert (encoders): load in stock transformers without llmstack; "
        "sentence-transformers (embedding models): loads in SentenceTransformer(path); "
        "llmstack: needs `import llmstack`",
    )
    p.add_argument(
        "--task",
        help="of a multi-task model: the sequence classification task whose head exports with the trunk "
        "(to the stock *ForSequenceClassification of --format)",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="accept a training checkpoint without an llmstack manifest (nothing is ever unpickled)",
    )


def run(args: Namespace) -> None:
    export_hf(args.checkpoint, args.out, args.format, trust=args.trust_checkpoint, task=args.task)
    print(f"wrote {args.format} model to {args.out}")
