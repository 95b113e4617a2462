from llmstack.training.export import FORMATS, export_hf


def add_arguments(p):
    p.add_argument("checkpoint", help="training checkpoint directory (OUT_DIR/checkpoints[/global_stepN]) or model directory")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", choices=FORMATS, default="llmstack",
                   help="llama: loads in stock transformers without llmstack; llmstack: needs `import llmstack`")


def run(args):
    export_hf(args.checkpoint, args.out, args.format)
    print(f"wrote {args.format} model to {args.out}")
