"""`llmstack generate`: sample continuations of prompts, streaming a single prompt's tokens."""

import argparse
import json

from llmstack.errors import UserError

from .output import result_stdout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="accept a training checkpoint without an llmstack manifest (nothing is ever unpickled)",
    )
    p.add_argument("--model", required=True, help="model directory (export-hf, merge-lora) or training checkpoint")
    p.add_argument("--prompt", required=True, action="append", help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=50, help="0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 disables")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument(
        "--output",
        choices=("text", "jsonl"),
        default="text",
        help="text: prompt + completion (one prompt streams); jsonl: one "
        '{"prompt", "completion"} object per line, for programs',
    )
    p.add_argument("--device", help="default: cuda if available, else cpu")


def run(args: argparse.Namespace) -> None:
    from llmstack.inference.sampling import SamplingParams

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as e:
        raise UserError(str(e)) from None
    with result_stdout() as out:
        # Imported here: they import DeepSpeed, whose logger writes to the stdout of that moment.
        from llmstack.inference.generate import generate_text
        from llmstack.inference.text_stream import StopAwareStreamer
        from llmstack.training.loading import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(args.model, args.device, trust=args.trust_checkpoint, causal=True)
        options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, stop_strings=args.stop)
        if len(args.prompt) == 1 and args.output == "text":
            out.write(args.prompt[0])
            streamer = StopAwareStreamer(tokenizer, lambda text: (out.write(text), out.flush()), args.stop)
            generate_text(model, tokenizer, args.prompt, streamer=streamer, **options)
            out.write("\n")
            return
        completions = generate_text(model, tokenizer, args.prompt, **options)
        for prompt, completion in zip(args.prompt, completions):
            if args.output == "jsonl":
                out.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            else:
                out.write(prompt + completion + "\n\n")
