"""`llmstack generate`: sample continuations of prompts, streaming a single prompt's tokens; with an
encoder-decoder, the decoder's output for each prompt (llmstack.inference.seq2seq)."""

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmstack.errors import UserError, require

from . import speculative
from .output import result_stdout

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from llmstack.inference.sampling import SamplingParams
    from llmstack.inference.speculative import SpeculativeConfig


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
    speculative.add_arguments(p)


def run(args: argparse.Namespace) -> None:
    from llmstack.inference.sampling import SamplingParams

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as e:
        raise UserError(str(e)) from None
    spec = speculative.config(args)
    if spec is not None:
        require("prometheus_client", "serve")  # speculation runs in the serving engine
    with result_stdout() as out:
        # Imported here: they import DeepSpeed, whose logger writes to the stdout of that moment.
        from llmstack.inference.generate import generate_text
        from llmstack.inference.text_stream import StopAwareStreamer
        from llmstack.training.loading import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(args.model, args.device, trust=args.trust_checkpoint, causal=True)
        options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, stop_strings=args.stop)
        stream = len(args.prompt) == 1 and args.output == "text"

        def write(text: str) -> None:
            out.write(text)
            out.flush()

        if stream:
            out.write(args.prompt[0])
        if getattr(model.config, "is_encoder_decoder", False):
            if spec is not None:
                raise UserError(
                    "speculative decoding runs decoder-only models; drop --speculative for an encoder-decoder"
                )
            from llmstack.inference.seq2seq import generate_seq2seq

            completions = generate_seq2seq(model, tokenizer, args.prompt, **options)
            if stream:
                write(completions[0])
        elif spec is not None:
            draft = speculative.load_draft(args, tokenizer, args.device)
            completions = generate_speculative(model, tokenizer, args, sampling, spec, draft, write if stream else None)
        elif stream:
            streamer = StopAwareStreamer(tokenizer, write, args.stop)
            completions = generate_text(model, tokenizer, args.prompt, streamer=streamer, **options)
        else:
            completions = generate_text(model, tokenizer, args.prompt, **options)
        if stream:
            out.write("\n")
            return
        for prompt, completion in zip(args.prompt, completions):
            if args.output == "jsonl":
                out.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
            else:
                out.write(prompt + completion + "\n\n")


def generate_speculative(
    model: "PreTrainedModel",
    tokenizer: "PreTrainedTokenizerBase",
    args: argparse.Namespace,
    sampling: "SamplingParams",
    spec: "SpeculativeConfig",
    draft: "PreTrainedModel | None",
    write: Callable[[str], None] | None,
) -> list[str]:
    """The prompts' completions (each cut before its first stop string), decoded together by the
    serving engine with speculation; `write` gets the first one's text as it comes."""
    from llmstack.inference.serve.engine import Event, GenerationRequest, RequestRejected
    from llmstack.inference.serve.server import batch_engine

    prompt_ids = [tokenizer(p)["input_ids"] for p in args.prompt]
    longest = max(len(p) for p in prompt_ids) + args.max_new_tokens
    try:
        engine = batch_engine(model, tokenizer, len(prompt_ids), longest, speculative=spec, draft=draft)
    except ValueError as e:
        raise UserError(str(e)) from None
    texts: list[list[str]] = [[] for _ in prompt_ids]
    errors: list[str] = []

    def collect(i: int) -> Callable[[Event], None]:
        def on_event(event: Event) -> None:
            if event.error:
                errors.append(event.error)
            texts[i].append(event.text)
            if write is not None and i == 0:
                write(event.text)

        return on_event

    for i, ids in enumerate(prompt_ids):
        request = GenerationRequest(
            ids, args.max_new_tokens, sampling, tuple(args.stop), args.seed, on_event=collect(i)
        )
        try:
            engine.submit(request)
        except RequestRejected as e:
            raise UserError(str(e).replace("max_tokens", "--max-new-tokens")) from None
    while engine.waiting or engine.running:
        engine.step()
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    return ["".join(t) for t in texts]
