"""`llmstack export-onnx`: the decoder as an ONNX graph with KV-cache inputs and outputs."""

import argparse
import os

from llmstack.errors import UserError, require


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="model directory (export-hf, merge-lora) or training checkpoint")
    p.add_argument("out", metavar="OUT", help="directory to write model.onnx, the tokenizer and config.json to")
    p.add_argument(
        "--int8", action="store_true", help="also write model.int8.onnx, weights dynamically quantized to int8"
    )
    p.add_argument("--opset", type=int, default=17)
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="accept a training checkpoint without an llmstack manifest (nothing is ever unpickled)",
    )


def run(args: argparse.Namespace) -> None:
    if not os.path.exists(args.model):
        raise UserError(f"model {args.model} not found")
    for module in ("onnx", "onnxruntime"):  # torch's exporter needs onnx
        require(module, "onnx")
    from llmstack.inference.onnx_export import export_onnx, quantize_int8
    from llmstack.training.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model, "cpu", trust=args.trust_checkpoint, causal=True)
    path = os.path.join(args.out, "model.onnx")
    export_onnx(model, path, opset=args.opset)
    model.config.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    written = [path]
    if args.int8:
        written.append(os.path.join(args.out, "model.int8.onnx"))
        quantize_int8(path, written[-1])
    print("\n".join(written))
