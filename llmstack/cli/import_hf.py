import os

from llmstack.errors import UserError


def add_arguments(p):
    p.add_argument("source", help="a Llama-architecture Hugging Face model directory")
    p.add_argument("out", help="output llmstack model directory")


def run(args):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from llmstack.models import from_llama

    if not os.path.isfile(os.path.join(args.source, "config.json")):
        raise UserError(f"{args.source} is not a Hugging Face model directory (no config.json)")
    try:
        model = from_llama(LlamaForCausalLM.from_pretrained(args.source))
    except ValueError as e:
        raise UserError(f"{args.source}: {e}") from None
    model.save_pretrained(args.out)
    if os.path.isfile(os.path.join(args.source, "tokenizer.json")):
        AutoTokenizer.from_pretrained(args.source).save_pretrained(args.out)
    print(f"wrote llmstack model to {args.out}")
