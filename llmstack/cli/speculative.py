"""The speculative-decoding options `generate` and `serve` share."""

import argparse
import os
from typing import TYPE_CHECKING

from llmstack.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from llmstack.inference.speculative import SpeculativeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=("ngram", "draft"),
        help="speculative decoding: ngram guesses from earlier text (prompt lookup), draft from --draft-model",
    )
    p.add_argument("--draft-model", metavar="DIR", help="a smaller model with the same tokenizer (--speculative draft)")
    p.add_argument("--speculative-tokens", type=int, default=4, help="tokens guessed per step")
    p.add_argument("--ngram-max", type=int, default=3, help="longest n-gram prompt lookup matches")


def config(args: argparse.Namespace) -> "SpeculativeConfig | None":
    """The parsed options, checked before any model loads; None without --speculative."""
    if args.draft_model and args.speculative != "draft":
        raise UserError("--draft-model needs --speculative draft")
    if args.speculative is None:
        return None
    if args.speculative == "draft" and not args.draft_model:
        raise UserError("--speculative draft needs --draft-model DIR")
    if args.draft_model and not os.path.exists(args.draft_model):
        raise UserError(f"draft model {args.draft_model} not found")
    from llmstack.inference.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig(args.speculative, args.speculative_tokens, max(args.ngram_max, 1), 1)
    except ValueError as e:
        raise UserError(f"{e} (--speculative-tokens)") from None


def load_draft(
    args: argparse.Namespace, tokenizer: "PreTrainedTokenizerBase", device: str | None
) -> "PreTrainedModel | None":
    """The draft model of --draft-model, refused unless its tokenizer is the model's."""
    if not args.draft_model:
        return None
    from llmstack.training.loading import load_model_and_tokenizer

    draft, draft_tokenizer = load_model_and_tokenizer(
        args.draft_model, device, trust=args.trust_checkpoint, causal=True
    )
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"the draft model {args.draft_model} has another tokenizer than the model: it must share it")
    return draft
