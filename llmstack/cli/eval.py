"""`llmstack eval`: perplexity and next-token accuracy of a model on held-out packed data, with the
tokens scored; for a masked LM (an encoder), on the tokens masked as in training; for an
encoder-decoder, on the targets of the blocks span-corrupted as in training, with exact-span
accuracy; for an embedding model, retrieval recall@1 and @10 on held-out (query, positive) pairs
(--pairs)."""

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
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", nargs="+", metavar="PREFIX", help="packed shards (PREFIX.bin/.idx)")
    data.add_argument(
        "--pairs", nargs="+", metavar="JSONL", help="embedding models: held-out {query, positive} pairs (JSONL)"
    )
    p.add_argument("--seq-len", type=int, help="tokens scored per block (default: the model's context length)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, help="evaluate only the first N blocks")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument(
        "--mlm-probability",
        type=float,
        default=0.15,
        help="masked LMs: share of tokens masked and scored (default 0.15, as training's validation)",
    )
    p.add_argument(
        "--mask-seed",
        type=int,
        default=0,
        help="masked LMs and encoder-decoders: seed of the masking or span corruption (0, as training's validation)",
    )
    p.add_argument(
        "--noise-density",
        type=float,
        default=0.15,
        help="encoder-decoders: share of tokens in corrupted spans (default 0.15, T5's)",
    )
    p.add_argument(
        "--mean-noise-span-length",
        type=float,
        default=3.0,
        help="encoder-decoders: mean length of a corrupted span (default 3, T5's)",
    )
    p.add_argument(
        "--document-masking",
        action="store_true",
        help="attend within each packed document, positions from 0 in each (as a run with data.document_masking)",
    )


def run(args: Namespace) -> None:
    with result_stdout() as out:
        print(json.dumps(evaluate(args)), file=out)


def evaluate(args: Namespace) -> dict[str, Any]:
    from llmstack.data.blocks import PackedBlocks
    from llmstack.data.mlm import MaskedBlocks
    from llmstack.training.evaluate import BatchNLL, evaluate_perplexity, masked_lm_nll, model_nll
    from llmstack.training.export import MASKED_LM_MODEL_TYPES, SEQ2SEQ_MODEL_TYPES
    from llmstack.training.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model, args.device, trust=args.trust_checkpoint)
    if model.config.model_type in SEQ2SEQ_MODEL_TYPES:
        return span_corruption(model, tokenizer, args)
    seq_len = args.seq_len or model.config.max_position_embeddings
    if getattr(args, "pairs", None):
        return retrieval(model, tokenizer, args, seq_len)
    document_masking = bool(getattr(args, "document_masking", False))
    if seq_len > model.config.max_position_embeddings:
        raise UserError(f"--seq-len {seq_len} exceeds the model's context of {model.config.max_position_embeddings}")
    blocks: PackedBlocks
    batch_nll: BatchNLL
    if model.config.model_type in MASKED_LM_MODEL_TYPES:
        if not 0.0 < args.mlm_probability < 1.0:
            raise UserError(f"--mlm-probability must be between 0 and 1; got {args.mlm_probability}")
        mask_id, vocab = model.config.mask_token_id, len(tokenizer)
        blocks = MaskedBlocks(
            args.data,
            seq_len,
            mask_id,
            vocab,
            args.mlm_probability,
            args.mask_seed,
            False,
            tokenizer.all_special_ids,
            document_masking=document_masking,
        )
        batch_nll = masked_lm_nll
    else:
        blocks = PackedBlocks(args.data, seq_len, shuffle=False, document_masking=document_masking)
        batch_nll = model_nll
    samples = min(args.max_samples or blocks.num_blocks, blocks.num_blocks)
    batches = blocks.eval_batches(samples, args.batch_size, 0, 1)
    result = evaluate_perplexity(model, batches, batch_nll=batch_nll)
    return {**result, "blocks": samples, "seq_len": seq_len}


def span_corruption(model: Any, tokenizer: Any, args: Namespace) -> dict[str, Any]:
    """Loss, perplexity and exact-span accuracy of an encoder-decoder on held-out blocks of
    --seq-len tokens, span-corrupted as the trainer's validation corrupts them."""
    from llmstack.data.span_corruption import SpanCorruptedBlocks, SpanCorruption, sentinel_ids
    from llmstack.training.evaluate import evaluate_perplexity, span_corruption_nll

    if getattr(args, "pairs", None):
        raise UserError(f"{args.model} is an encoder-decoder; --pairs scores embedding models")
    if not args.seq_len:
        raise UserError("an encoder-decoder's blocks have no default length: give --seq-len (the run's data.seq_len)")
    if not 0.0 < args.noise_density < 1.0:
        raise UserError(f"--noise-density must be between 0 and 1; got {args.noise_density}")
    corruption = SpanCorruption(
        sentinel_ids(tokenizer), tokenizer.eos_token_id, args.noise_density, args.mean_noise_span_length, args.mask_seed
    )
    blocks = SpanCorruptedBlocks(args.data, args.seq_len, corruption, shuffle=False)
    samples = min(args.max_samples or blocks.num_blocks, blocks.num_blocks)
    batches = blocks.eval_batches(samples, args.batch_size, 0, 1)
    result = evaluate_perplexity(model, batches, batch_nll=span_corruption_nll)
    return {**result, "blocks": samples, "seq_len": args.seq_len}


def retrieval(model: Any, tokenizer: Any, args: Namespace, seq_len: int) -> dict[str, Any]:
    """recall@1 and @10 of an embedding model on held-out pairs, each query against every pair's positive."""
    from llmstack.data.pairs import PairData
    from llmstack.models import LLMStackForEmbedding
    from llmstack.training.contrastive import retrieval_recall

    if not isinstance(model, LLMStackForEmbedding):
        raise UserError(
            f"{args.model} is not an embedding model; --pairs scores embedding models (train.objective contrastive)"
        )
    pairs = PairData(args.pairs, tokenizer, seq_len, shuffle=False)
    samples = min(args.max_samples or pairs.num_blocks, pairs.num_blocks)
    device = next(model.parameters()).device
    batches = pairs.eval_batches(samples, args.batch_size, 0, 1)
    result = retrieval_recall(lambda batch: model(**{k: v.to(device) for k, v in batch.items()}).embeddings, batches)
    return {**result, "seq_len": seq_len}
