"""`llmstack eval`: perplexity of a model on held-out packed data, with the tokens scored."""

import json
from argparse import ArgumentParser, Namespace
from typing import Any

from llmstack.errors import UserError

from .output import result_stdout


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="accept a training checkpoint without an llmstack manifest (nothing is ever unpickled)",
    )
    p.add_argument("--model", required=True, help="model directory (export-hf, merge-lora) or training checkpoint")
    p.add_argument("--data", required=True, nargs="+", metavar="PREFIX", help="packed shards (PREFIX.bin/.idx)")
    p.add_argument("--seq-len", type=int, help="tokens scored per block (default: the model's context length)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, help="evaluate only the first N blocks")
    p.add_argument("--device", help="default: cuda if available, else cpu")


def run(args: Namespace) -> None:
    with result_stdout() as out:
        print(json.dumps(evaluate(args)), file=out)


def evaluate(args: Namespace) -> dict[str, Any]:
    from llmstack.data.blocks import PackedBlocks
    from llmstack.training.evaluate import evaluate_perplexity
    from llmstack.training.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(args.model, args.device, trust=args.trust_checkpoint)
    seq_len = args.seq_len or model.config.max_position_embeddings
    if seq_len > model.config.max_position_embeddings:
        raise UserError(f"--seq-len {seq_len} exceeds the model's context of {model.config.max_position_embeddings}")
    blocks = PackedBlocks(args.data, seq_len, shuffle=False)
    samples = min(args.max_samples or blocks.num_blocks, blocks.num_blocks)
    result = evaluate_perplexity(model, blocks.eval_batches(samples, args.batch_size, 0, 1))
    return {**result, "blocks": samples, "seq_len": seq_len}
