"""`llmstack generate`: sample continuations of prompts, streaming a single prompt's tokens."""

from transformers import TextStreamer

from llmstack.errors import UserError


def add_arguments(p):
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="accept a training checkpoint without an llmstack manifest (nothing is ever unpickled)")
    p.add_argument("--model", required=True, help="model directory (export-hf, merge-lora) or training checkpoint")
    p.add_argument("--prompt", required=True, action="append", help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=50, help="0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 disables")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables")
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--device", help="default: cuda if available, else cpu")


def run(args):
    from llmstack.inference.generate import generate_text
    from llmstack.training.loading import load_model_and_tokenizer
    from llmstack.inference.sampling import SamplingParams

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as e:
        raise UserError(str(e)) from None
    model, tokenizer = load_model_and_tokenizer(args.model, args.device, trust=args.trust_checkpoint)
    options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, stop_strings=args.stop)
    if len(args.prompt) == 1:
        print(args.prompt[0], end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        generate_text(model, tokenizer, args.prompt, streamer=streamer, **options)
        return
    for prompt, completion in zip(args.prompt, generate_text(model, tokenizer, args.prompt, **options)):
        print(prompt + completion, end="\n\n")
