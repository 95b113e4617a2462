"""`llmstack serve`: an OpenAI-compatible HTTP server with continuous batching."""

import argparse
import os

from llmstack.errors import UserError, require

from . import speculative


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="model directory (export-hf, merge-lora) or training checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name clients put in `model` (default: the directory's name)")
    p.add_argument(
        "--kv-cache-mb",
        type=float,
        default=256,
        help="memory for the KV cache, in MiB; it holds this many context-long slots, one per running request",
    )
    p.add_argument("--max-running", type=int, default=32, help="most requests decoded together")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests past which new ones get 429")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=512,
        help="with --chunked-prefill-size 0: prompt tokens admitted per step (at least one prompt, "
        "prefilled whole), so a burst of long prompts does not stall the running requests",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="most prompt tokens prefilled per step (SGLang's name): a longer prompt is prefilled in "
        "chunks of this many tokens, one per step beside the running requests' decode; 0 turns it off",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=0,
        help="memory for keys/values of prompt prefixes kept for later requests that share them "
        "(least recently used evicted), in MiB; 0 (the default) turns prefix caching off",
    )
    p.add_argument(
        "--prefix-block-size",
        type=int,
        default=16,
        help="tokens per prefix cache block: prompts share cached prefixes in whole blocks",
    )
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template for a tokenizer that has none")
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="accept a training checkpoint without an llmstack manifest (nothing is ever unpickled)",
    )
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's); 1 on a shared, busy CPU")
    speculative.add_arguments(p)


def run(args: argparse.Namespace) -> None:
    check_arguments(args)
    spec = speculative.config(args)
    uvicorn = require("uvicorn", "serve")
    for module in ("fastapi", "prometheus_client"):
        require(module, "serve")
    import torch

    from llmstack.inference.serve.api import create_app
    from llmstack.inference.serve.server import build_engine
    from llmstack.training.loading import load_model_and_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, args.device, trust=args.trust_checkpoint, causal=True)
    if args.chat_template:
        with open(args.chat_template) as f:
            tokenizer.chat_template = f.read()
    draft = speculative.load_draft(args, tokenizer, args.device)
    try:
        engine = build_engine(
            model,
            tokenizer,
            kv_cache_mb=args.kv_cache_mb,
            max_running=args.max_running,
            max_waiting=args.max_waiting,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            speculative=spec,
            draft=draft,
            prefix_cache_mb=args.prefix_cache_mb,
            prefix_block_size=args.prefix_block_size,
        )
    except ValueError as e:
        if "KV cache" in str(e):
            raise UserError(f"{e}: raise --kv-cache-mb") from None
        if "prefix cache" in str(e):
            raise UserError(f"{e}: raise --prefix-cache-mb or lower --prefix-block-size") from None
        raise UserError(str(e)) from None
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    uvicorn.run(create_app(engine, name), host=args.host, port=args.port)


def check_arguments(args: argparse.Namespace) -> None:
    """The mistakes a user can make, found before the model loads."""
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535; got {args.port}")
    for option in ("kv_cache_mb", "max_running", "max_waiting", "max_prefill_tokens", "threads"):
        if getattr(args, option) is not None and getattr(args, option) <= 0:
            raise UserError(f"--{option.replace('_', '-')} must be positive; got {getattr(args, option)}")
    if args.chunked_prefill_size < 0:
        raise UserError(f"--chunked-prefill-size must be >= 0 (0: off); got {args.chunked_prefill_size}")
    if args.prefix_cache_mb < 0:
        raise UserError(f"--prefix-cache-mb must be >= 0; got {args.prefix_cache_mb}")
    if args.prefix_block_size <= 0:
        raise UserError(f"--prefix-block-size must be positive; got {args.prefix_block_size}")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise UserError(f"chat template {args.chat_template} not found")
    if not os.path.exists(args.model):
        raise UserError(f"model {args.model} not found")
