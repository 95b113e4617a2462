import os
from argparse import ArgumentParser, Namespace

from llmstack.errors import UserError


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument("source", help="a Hugging Face model directory of the Llama, Mistral or Qwen2 family")
    p.add_argument("out", help="output llmstack model directory")


def run(args: Namespace) -> None:
    from llmstack.models import LLMStackForCausalLM
    from llmstack.models.pretrained import (
        PretrainedWeights,
        is_pretrained_dir,
        load_pretrained_weights,
        pretrained_config,
    )

    if not is_pretrained_dir(args.source):
        raise UserError(f"{args.source} is not a Hugging Face model directory (config.json and *.safetensors)")
    try:
        model = LLMStackForCausalLM(pretrained_config(args.source))
        load_pretrained_weights(model, args.source)
    except ValueError as e:
        raise UserError(f"{args.source}: {e}") from None
    model.to(PretrainedWeights(args.source)["model.embed_tokens.weight"].dtype).save_pretrained(args.out)  # type: ignore[arg-type]  # @wraps'd .to
    if os.path.isfile(os.path.join(args.source, "tokenizer.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.source).save_pretrained(args.out)
    print(f"wrote llmstack model to {args.out}")
