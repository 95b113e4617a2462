"""Encoder-decoders trained on T5's span corruption: the noise mask and sentinels, exact resume of
the corruption, exact-span accuracy, export to stock T5ForConditionalGeneration with equal logits,
the Trainer on 1 and 2 ranks (ZeRO-1, ZeRO-3), and `llmstack eval` / `generate` on the results."""

import json
import subprocess
import sys
from argparse import Namespace

import numpy as np
import pytest
import torch
from conftest import WITHOUT_LLMSTACK

from llmstack.data.span_corruption import (
    SpanCorruptedBlocks,
    SpanCorruption,
    corrupt_spans,
    random_spans_noise_mask,
    sentinel_ids,
    span_counts,
)
from llmstack.errors import UserError
from llmstack.models import LLMStackForSpanCorruption, LLMStackT5Config
from llmstack.models.loss import span_predictions
from llmstack.parallel.layout import check_layout
from llmstack.testing import run_distributed
from llmstack.training.config import parse_run_config, run_layout

SEQ_LEN = 32  # 5 noise tokens in 2 spans per block
TINY_T5 = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
}


@pytest.fixture(scope="module")
def t5_data(tmp_path_factory):
    """A tokenizer with 8 sentinels and packed train/valid shards."""
    from llmstack.data.pack import pack_documents
    from llmstack.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("t5_data")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 30)) for i in range(300)]
    tokenizer = train_tokenizer(texts, 256, root / "tokenizer", sentinels=8)
    pack_documents(texts[:270], tokenizer, root / "train")
    pack_documents(texts[270:], tokenizer, root / "valid")
    return {"tokenizer": str(root / "tokenizer"), "train": [str(root / "train")], "valid": [str(root / "valid")]}


def tiny_t5(**overrides) -> LLMStackForSpanCorruption:
    torch.manual_seed(0)
    config = LLMStackT5Config(vocab_size=64, pad_token_id=1, eos_token_id=0, **{**TINY_T5, **overrides})
    model = LLMStackForSpanCorruption(config).eval()
    with torch.no_grad():  # larger than the initialisation, so that every weight shows in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def test_noise_mask_has_t5s_counts_and_spans_and_the_corruption_is_lossless():
    rng = np.random.default_rng(0)
    sentinels = list(range(1000, 1100))
    lengths = []
    for length in (20, 64, 256, 512):
        noise_tokens, spans = span_counts(length, 0.15, 3.0)
        assert (noise_tokens, spans) == (round(length * 0.15), max(round(round(length * 0.15) / 3), 1))
        for _ in range(20):
            noise = random_spans_noise_mask(length, 0.15, 3.0, rng)
            starts = noise & ~np.concatenate([[False], noise[:-1]])
            assert noise.sum() == noise_tokens and starts.sum() == spans and not noise[0]
            tokens = rng.integers(2000, 3000, length)
            inputs, targets, span_ids = corrupt_spans(tokens, noise, sentinels, 0)
            assert len(inputs) == length - noise_tokens + spans + 1 and inputs[-1] == 0
            assert len(targets) == noise_tokens + spans + 1 and targets[-1] == 0 and span_ids[-1] == -1
            # Putting each sentinel's span back into the inputs gives the tokens again.
            restored = []
            for token in inputs[:-1]:
                if token >= 1000 and token < 2000:
                    restored += [
                        t
                        for t, s in zip(targets, span_ids)
                        if s == token - 1000 and t < 1000 or t >= 2000 and s == token - 1000
                    ]
                else:
                    restored.append(token)
            assert np.array_equal(restored, tokens)
            assert np.array_equal(targets[span_ids >= 0][np.isin(targets[span_ids >= 0], sentinels)], sentinels[:spans])
            lengths += list(np.diff(np.flatnonzero(np.diff(np.concatenate([[0], noise, [0]])))))[::2]
    assert np.mean(lengths) == pytest.approx(3.0, abs=0.1)  # noise / spans: 2.75-3.0 by length


def test_blocks_resume_exactly_on_any_number_of_ranks(t5_data):
    from llmstack.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(t5_data["tokenizer"])
    corruption = SpanCorruption(sentinel_ids(tokenizer), tokenizer.eos_token_id, seed=7)
    assert corruption.sentinel_ids == tuple(tokenizer.convert_tokens_to_ids(f"<extra_id_{k}>") for k in range(8))
    blocks = SpanCorruptedBlocks(t5_data["train"], SEQ_LEN, corruption)
    run = blocks.micro_batches(0, 2, 0, 1)
    first = [next(run) for _ in range(6)]  # 12 samples on one rank
    assert first[0]["input_ids"].shape == (2, SEQ_LEN - 5 + 2 + 1) and first[0]["labels"].shape == (2, 5 + 2 + 1)
    # Samples 4-11 again on 2 ranks from consumed_samples 4, as after a resume: the same corruption.
    again = SpanCorruptedBlocks(t5_data["train"], SEQ_LEN, corruption)
    for rank in (0, 1):
        batches = again.micro_batches(4, 2, rank, 2)
        for k in range(2):
            batch, sample = next(batches), 4 + 4 * k + 2 * rank
            expected = first[sample // 2]
            for name in ("input_ids", "labels", "span_ids"):
                assert torch.equal(batch[name], expected[name])


def test_span_accuracy_counts_a_span_only_when_every_target_is_predicted():
    targets = torch.tensor([[10, 3, 4, 11, 5, 0], [10, 6, 11, 7, 8, 0]])
    span_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 1, 1, 1, -1]])
    predicted = targets.clone()
    predicted[0, 4] = 9  # span 1 of the first sequence misses a token
    predicted[1, 5] = 9  # the final EOS is no span's
    logits = torch.nn.functional.one_hot(predicted, 16).float()
    correct, present = span_predictions(logits, targets, span_ids)
    assert present.all() and correct.tolist() == [[True, False], [True, True]]


EQUAL_LOGITS = (
    WITHOUT_LLMSTACK
    + """
import sys, numpy as np, torch

from transformers import AutoModelForSeq2SeqLM
model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1]).eval()
data = np.load(sys.argv[1] + "/reference.npz")
with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(data["ids"]), attention_mask=torch.from_numpy(data["mask"]),
                   labels=torch.from_numpy(data["labels"])).logits
print(type(model).__name__, np.abs(logits.numpy() - data["logits"]).max())
"""
)


def test_export_to_t5_gives_equal_logits_without_llmstack(tmp_path):
    """Stacks of different depths, padding in the encoder's inputs; measured difference 0.0."""
    from llmstack.training.export import export_hf

    model = tiny_t5(num_decoder_layers=3)
    model.save_pretrained(tmp_path / "llmstack")
    export_hf(str(tmp_path / "llmstack"), str(tmp_path / "t5"), "t5")
    assert json.loads((tmp_path / "t5" / "config.json").read_text())["feed_forward_proj"] == "gated-silu"
    ids, labels = torch.randint(2, 64, (2, 20)), torch.randint(2, 64, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    np.savez(tmp_path / "t5" / "reference.npz", ids=ids, mask=mask, labels=labels, logits=logits)
    shown = subprocess.run(
        [sys.executable, "-c", EQUAL_LOGITS, str(tmp_path / "t5")], capture_output=True, text=True, check=True
    )
    name, diff = shown.stdout.split()
    assert name == "T5ForConditionalGeneration" and float(diff) < 1e-5
    with pytest.raises(UserError, match="is an encoder-decoder; export it with --format t5 or llmstack"):
        export_hf(str(tmp_path / "llmstack"), str(tmp_path / "llama"), "llama")


def t5_run_config(t5_data, out_dir, **train):
    return {
        "model": dict(TINY_T5),
        "data": {**t5_data, "seq_len": SEQ_LEN},
        "train": {
            "objective": "span_corruption",
            "out_dir": str(out_dir),
            "micro_batch_size": 4,
            "max_steps": 3,
            "lr": 3e-3,
            "warmup_steps": 1,
            "log_interval": 1,
            "eval_interval": 100,
            "eval_samples": 8,
            "save_interval": 100,
            **train,
        },
        "monitor": {"console": False},
    }


def _train(rank, world_size, raw, ds_config):
    from llmstack.training import Trainer

    trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config)
    trainer.train()
    return type(trainer.engine.module).__name__


def _metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def trained_runs(t5_data, tmp_path_factory):
    """The same global batch of 4 on 1 process (ZeRO-1) and on 2 ranks (ZeRO-1 and ZeRO-3)."""
    root = tmp_path_factory.mktemp("t5_runs")
    runs = {}
    for name, ranks, stage in (("one", 1, 1), ("two", 2, 1), ("two_zero3", 2, 3)):
        raw = t5_run_config(t5_data, root / name, micro_batch_size=4 // ranks)
        assert (
            run_distributed(_train, ranks, args=(raw, f"ds_configs/zero{stage}.json"))
            == ["LLMStackForSpanCorruption"] * ranks
        )
        runs[name] = root / name
    return runs


def test_two_ranks_train_as_one_process_at_zero_1_and_3(trained_runs):
    losses = {name: [r["loss"] for r in _metrics(out) if "loss" in r] for name, out in trained_runs.items()}
    assert len(losses["one"]) == 3 and losses["one"][-1] < losses["one"][0]
    for name in ("two", "two_zero3"):
        assert np.abs(np.subtract(losses[name], losses["one"])).max() < 1e-5, (name, losses)
    records = _metrics(trained_runs["two_zero3"])
    assert all(0.0 <= r["span_accuracy"] <= 1.0 for r in records if "loss" in r)
    final = [r for r in records if "val_loss" in r][-1]
    assert 0.0 <= final["val_span_accuracy"] <= 1.0 and "val_accuracy" not in final


def test_eval_and_generate_on_the_checkpoint_and_its_t5_export(trained_runs, t5_data, tmp_path):
    from llmstack.cli.eval import evaluate
    from llmstack.training.export import export_hf

    run = trained_runs["two_zero3"]
    final = [r for r in _metrics(run) if "val_loss" in r][-1]
    export_hf(str(run / "checkpoints"), str(tmp_path / "t5"), "t5")
    for model in (run / "checkpoints", tmp_path / "t5"):
        args = Namespace(
            model=str(model),
            data=t5_data["valid"],
            seq_len=SEQ_LEN,
            batch_size=4,
            max_samples=8,
            device="cpu",
            trust_checkpoint=False,
            noise_density=0.15,
            mean_noise_span_length=3.0,
            mask_seed=0,
        )
        result = evaluate(args)
        assert set(result) == {"loss", "perplexity", "tokens", "span_accuracy", "blocks", "seq_len"}
        # The trainer's final validation corrupted the same blocks (over 2 ranks): the same numbers.
        assert result["loss"] == pytest.approx(final["val_loss"], rel=1e-5)
        assert result["span_accuracy"] == pytest.approx(final["val_span_accuracy"], abs=1e-9)
        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmstack",
                "generate",
                "--model",
                str(model),
                "--prompt",
                "the quick <extra_id_0> fox",
                "--prompt",
                "a lazy dog",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
                "--output",
                "jsonl",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        lines = [json.loads(line) for line in shown.stdout.splitlines()]
        assert [line["prompt"] for line in lines] == ["the quick <extra_id_0> fox", "a lazy dog"]
        assert all(isinstance(line["completion"], str) for line in lines)


def test_layouts_and_tokenizers_it_cannot_use_are_refused(t5_data, tiny_data, tmp_path):
    raw = t5_run_config(t5_data, tmp_path)
    raw["train"]["tensor_parallel_size"] = 2
    with pytest.raises(UserError, match="a span-corruption encoder-decoder with tensor, pipeline or context"):
        check_layout(run_layout(parse_run_config(raw), {"zero_optimization": {"stage": 1}}))
    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.training.trainer import build_train_data

    run = parse_run_config(t5_run_config(t5_data, tmp_path))
    with pytest.raises(UserError, match="has 0 sentinel tokens: train one with .*--sentinels 2"):
        build_train_data(run.data, load_tokenizer(tiny_data["tokenizer"]), "span_corruption")
    raw = t5_run_config(t5_data, tmp_path)
    raw["train"]["objective"] = "causal"
    with pytest.raises(UserError, match="model.num_decoder_layers.* configure the encoder-decoder"):
        parse_run_config(raw)
    with pytest.raises(ValueError, match="activation='gelu' has no T5 v1.1 counterpart"):
        LLMStackT5Config(activation="gelu")
