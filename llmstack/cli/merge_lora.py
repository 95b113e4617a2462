"""`llmstack merge-lora`: fold a LoRA adapter into its base model and save a plain model."""

from argparse import ArgumentParser, Namespace


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="base model directory the adapter was trained on")
    p.add_argument("--adapter", required=True, help="adapter directory saved by `llmstack finetune`")
    p.add_argument("--out", required=True, help="output model directory")


def run(args: Namespace) -> None:
    from llmstack.training.finetune.lora import merge_lora

    merge_lora(args.base, args.adapter, args.out)
    print(f"wrote the merged model to {args.out}")
