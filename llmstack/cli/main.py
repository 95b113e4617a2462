"""The `llmstack` command. Each subcommand lives in its own module under llmstack.cli."""

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from llmstack.errors import UserError

# subcommand name -> module under llmstack.cli defining `add_arguments(parser)` and `run(args)`.
# Modules are imported only when their command runs, so `llmstack --help` stays fast.
COMMANDS = {
    "train": ("train", "pretrain a model with DeepSpeed"),
    "quickstart": ("quickstart", "build a corpus from the Python stdlib, train, evaluate, export, generate"),
    "export-hf": ("export_hf", "export a checkpoint or model directory to Hugging Face format"),
    "import-hf": ("import_hf", "convert a Llama, Mistral or Qwen2 Hugging Face model into an llmstack model"),
    "data": ("data", "prepare data: clean, filter, deduplicate, train the tokenizer, pack"),
    "generate": ("generate", "generate text from a trained model with a KV cache"),
    "finetune": ("finetune", "supervised fine-tuning (full or LoRA) on prompt/response JSONL"),
    "merge-lora": ("merge_lora", "merge LoRA adapter weights into a plain model"),
    "eval": ("eval", "perplexity of a model on held-out packed data"),
    "export-onnx": ("export_onnx", "export a model as an ONNX decoder with KV-cache inputs and outputs"),
    "serve": ("serve", "serve a model over an OpenAI-compatible HTTP API with continuous batching"),
    "plot": ("plot", "draw loss, grad norm, learning rate and throughput curves from a run directory"),
    "sweep": (
        "sweep",
        "short proxy runs over a grid or a random search of run-config values, ranked by validation loss",
    ),
    "plan": ("plan", "compute-optimal size and tokens, learning rate and batch, memory per GPU and time of a run"),
    "doctor": ("doctor", "report versions, accelerator, backend, buildable ops, memory and disk"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmstack", description="LLM pretraining stack on DeepSpeed.")
    # The deepspeed launcher passes --local_rank=N before the subcommand; LOCAL_RANK carries it too.
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load is None or load == name:
            importlib.import_module(f"llmstack.cli.{module}").add_arguments(p)
    return parser


# A run-config override, `section.key=value`.
OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=.*", re.DOTALL)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that run-config overrides may come between and after the
    options (`--resume auto a.b=1 c.d=2`, `a.b=1 --resume auto c.d=2`): argparse takes the first
    run of positionals only and would call the others unrecognized. They keep their order."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all(OVERRIDE.fullmatch(a) for a in extra):
        args.overrides = [*args.overrides, *extra]
        return args
    return parser.parse_args(argv)  # argparse's own message for what it does not know


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    try:  # importing a command's module may refuse an unsupported DeepSpeed or transformers (llmstack.compat)
        args = parse_args(build_parser(load=command or ""), argv)
        module = importlib.import_module(f"llmstack.cli.{COMMANDS[args.command][0]}")
        return module.run(args) or 0
    except UserError as e:
        print(f"llmstack {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
