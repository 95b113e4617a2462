"""Masked-LM encoders: BERT's masking statistics and exact resume, the loss on selected tokens only,
bidirectional attention, export to stock EuroBertForMaskedLM with equal logits, and a short run
through the Trainer that `llmstack eval` then scores."""

import json
import subprocess
import sys
from argparse import Namespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL

from llmstack.data.mlm import MaskedBlocks, mask_tokens
from llmstack.errors import UserError
from llmstack.models import LLMStackEncoderConfig, LLMStackForMaskedLM
from llmstack.models.loss import IGNORE_INDEX
from llmstack.parallel.layout import check_layout
from llmstack.testing import run_distributed
from llmstack.training.config import parse_run_config, run_layout

MASK_ID, VOCAB = 2, 256


@pytest.fixture(scope="module")
def encoder_data(tmp_path_factory):
    """A tokenizer with the encoder's special tokens and packed train/valid shards."""
    from llmstack.data.pack import pack_documents
    from llmstack.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("mlm_data")
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 30)) for i in range(300)]
    tokenizer = train_tokenizer(texts, 256, root / "tokenizer", encoder_tokens=True)
    pack_documents(texts[:270], tokenizer, root / "train")
    pack_documents(texts[270:], tokenizer, root / "valid")
    return {"tokenizer": str(root / "tokenizer"), "train": [str(root / "train")], "valid": [str(root / "valid")]}


def tiny_encoder(**overrides) -> LLMStackForMaskedLM:
    torch.manual_seed(0)
    config = LLMStackEncoderConfig(mask_token_id=MASK_ID, vocab_size=VOCAB, num_key_value_heads=2, **TINY_MODEL)
    config.update(overrides)
    return LLMStackForMaskedLM(config).eval()


def test_masking_selects_15_percent_and_replaces_80_10_10():
    tokens = np.random.default_rng(123).integers(3, VOCAB, 200_000)
    inputs, labels = mask_tokens(tokens, np.random.default_rng(0), MASK_ID, VOCAB)
    selected = labels != IGNORE_INDEX
    assert (labels[selected] == tokens[selected]).all()
    assert (inputs[~selected] == tokens[~selected]).all()  # only selected tokens change
    masked = inputs[selected] == MASK_ID
    unchanged = inputs[selected] == tokens[selected]
    random = ~masked & ~unchanged
    # Over 20 seeds on these 200k tokens: selected 0.1480-0.1516 (sd 0.0009), masked 0.794-0.805
    # (sd 0.0029), random 0.097-0.104 (sd 0.0016), unchanged 0.097-0.105 (sd 0.0021; it includes
    # random draws of the original token, 0.1/256). Bounds are 5 sd or more.
    assert selected.mean() == pytest.approx(0.15, abs=0.005)
    assert masked.mean() == pytest.approx(0.8, abs=0.015)
    assert random.mean() == pytest.approx(0.1, abs=0.012)
    assert unchanged.mean() == pytest.approx(0.1, abs=0.012)


def test_special_tokens_are_never_selected_and_the_others_mask_as_before():
    tokens = np.random.default_rng(5).integers(0, VOCAB, 20_000)
    plain = mask_tokens(tokens, np.random.default_rng(0), MASK_ID, VOCAB)
    inputs, labels = mask_tokens(tokens, np.random.default_rng(0), MASK_ID, VOCAB, special_ids=[0, 1])
    special = np.isin(tokens, [0, 1])
    assert special.sum() > 100
    assert (labels[special] == IGNORE_INDEX).all() and (inputs[special] == tokens[special]).all()
    assert np.array_equal(labels[~special], plain[1][~special])  # the same random stream decides the rest


def test_masked_blocks_resume_exactly_on_any_number_of_ranks(encoder_data):
    blocks = MaskedBlocks(encoder_data["train"], 16, MASK_ID, VOCAB, seed=7)
    run = blocks.micro_batches(0, 2, 0, 1)
    first = [next(run) for _ in range(6)]  # 12 samples on one rank
    assert first[0]["input_ids"].shape == first[0]["labels"].shape == (2, 16)
    resumed = blocks.micro_batches(4, 2, 0, 1)  # from consumed sample 4: the third micro-batch on
    for expected in first[2:4]:
        got = next(resumed)
        assert all(torch.equal(got[k], expected[k]) for k in ("input_ids", "labels"))
    # Two ranks read interleaved micro-batches of the same masked samples.
    rank1 = MaskedBlocks(encoder_data["train"], 16, MASK_ID, VOCAB, seed=7).micro_batches(0, 2, 1, 2)
    assert torch.equal(next(rank1)["input_ids"], first[1]["input_ids"])
    # The next epoch masks the same block afresh (64 tokens: the chance of equal masks is ~1e-9).
    plain = MaskedBlocks(encoder_data["train"], 64, MASK_ID, VOCAB, seed=7, shuffle=False)
    (inputs0, labels0), (inputs1, labels1) = plain.sample(0), plain.sample(plain.num_blocks)
    assert not np.array_equal(labels0, labels1)
    originals = [
        np.where(labels != IGNORE_INDEX, labels, inputs) for inputs, labels in ((inputs0, labels0), (inputs1, labels1))
    ]
    assert np.array_equal(*originals)


def test_loss_scores_the_selected_tokens_only():
    model = tiny_encoder()
    tokens = torch.randint(3, VOCAB, (2, 12))
    inputs, labels = (torch.from_numpy(a) for a in mask_tokens(tokens.numpy(), np.random.default_rng(1), 2, VOCAB))
    out = model(input_ids=inputs, labels=labels)
    selected = labels != IGNORE_INDEX
    by_hand = F.cross_entropy(out.logits[selected], tokens[selected])
    assert out.loss.item() == pytest.approx(by_hand.item(), abs=1e-6)
    # What stands at the other positions of the labels does not matter: they are never scored.
    assert 0 < selected.sum() < selected.numel()


def test_encoder_attends_both_ways_and_ignores_padding():
    model = tiny_encoder()
    ids = torch.randint(3, VOCAB, (1, 10))
    changed_last = ids.clone()
    changed_last[0, -1] = (ids[0, -1] + 1) % VOCAB
    with torch.no_grad():
        first = model(ids).logits[0, 0]
        assert not torch.allclose(model(changed_last).logits[0, 0], first)  # position 0 sees position 9
        padded = torch.cat([ids, torch.full((1, 3), 1)], dim=1)
        mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 3)], dim=1).long()
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, :10], model(ids).logits)


EQUAL_LOGITS = """
import sys, numpy as np, torch
from transformers import AutoModelForMaskedLM
for directory in sys.argv[1:]:
    model = AutoModelForMaskedLM.from_pretrained(directory).eval()
    data = np.load(directory + "/reference.npz")
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(data["ids"]), attention_mask=torch.from_numpy(data["mask"])).logits
    mask = data["mask"].astype(bool)
    print(type(model).__name__, np.abs(logits.numpy()[mask] - data["logits"][mask]).max())
assert "llmstack" not in sys.modules, "the check must not import llmstack"
"""


def test_export_to_eurobert_gives_equal_logits_without_llmstack(tmp_path):
    """A plain encoder and one with q/k/v biases (nonzero, so that the check sees them carried over)."""
    from llmstack.training.export import export_hf

    exported = []
    for qkv_bias in (False, True):
        model = tiny_encoder(qkv_bias=qkv_bias)
        if qkv_bias:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.q_proj.bias.normal_()
                    layer.self_attn.v_proj.bias.normal_()
        source, out = tmp_path / f"encoder-{qkv_bias}", tmp_path / f"eurobert-{qkv_bias}"
        model.save_pretrained(source)
        export_hf(str(source), str(out), "eurobert")
        ids = torch.randint(3, VOCAB, (2, 12))
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0  # padding: compared where the mask is 1
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        np.savez(out / "reference.npz", ids=ids.numpy(), mask=mask.numpy(), logits=logits.numpy())
        exported.append(str(out))
    lines = subprocess.run(
        [sys.executable, "-c", EQUAL_LOGITS, *exported], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        name, diff = line.split()
        assert name == "EuroBertForMaskedLM" and float(diff) < 1e-5
    with pytest.raises(UserError, match="is an encoder.*--format llmstack or eurobert"):
        export_hf(str(tmp_path / "encoder-False"), str(tmp_path / "llama"), "llama")


def test_mlm_run_config_refuses_what_the_encoder_does_not_support(tmp_path, encoder_data):
    raw = mlm_run_config(encoder_data, tmp_path)
    parse_run_config(raw)
    raw["model"].update(num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(UserError, match="a masked-LM encoder with a mixture-of-experts model"):
        check_layout(run_layout(parse_run_config(raw), {"zero_optimization": {"stage": 1}}))
    raw = mlm_run_config(encoder_data, tmp_path, objective="bert")
    with pytest.raises(UserError, match="train.objective must be one of causal, mlm"):
        parse_run_config(raw)


def test_tokenizer_without_mask_token_is_refused(tiny_data):
    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.training.construct import mask_token_id

    with pytest.raises(UserError, match="--encoder-tokens"):
        mask_token_id(load_tokenizer(tiny_data["tokenizer"]))


def mlm_run_config(encoder_data, out_dir, **train):
    return {
        "model": dict(TINY_MODEL),
        "data": {**encoder_data, "seq_len": 32},
        "train": {
            "objective": "mlm",
            "out_dir": str(out_dir),
            "ds_config": "ds_configs/zero3.json",
            "micro_batch_size": 4,
            "max_steps": 2,
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


def train_mlm(rank, world_size, raw):
    from llmstack.training import Trainer

    trainer = Trainer(parse_run_config(raw))
    trainer.train()
    return type(trainer.engine.module).__name__


def test_trainer_trains_an_encoder_and_eval_reports_masked_accuracy(tmp_path, encoder_data):
    from llmstack.cli.eval import evaluate

    # ZeRO-3 on 2 ranks: the encoder is built partitioned, and each rank validates half the blocks.
    raw = mlm_run_config(encoder_data, tmp_path / "run")
    assert run_distributed(train_mlm, 2, args=(raw,)) == ["LLMStackForMaskedLM"] * 2
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    final_eval = [r for r in records if "val_loss" in r][-1]
    assert 0.0 <= final_eval["val_accuracy"] <= 1.0
    args = Namespace(
        model=str(tmp_path / "run" / "checkpoints"),
        data=encoder_data["valid"],
        seq_len=32,
        batch_size=4,
        max_samples=8,
        device="cpu",
        trust_checkpoint=False,
        mlm_probability=0.15,
        mask_seed=0,
    )
    result = evaluate(args)
    assert set(result) == {"loss", "perplexity", "tokens", "accuracy", "blocks", "seq_len"}
    # The same masked blocks as the trainer's final validation (over 2 ranks): the same numbers.
    assert result["loss"] == pytest.approx(final_eval["val_loss"], rel=1e-5)
    assert result["accuracy"] == pytest.approx(final_eval["val_accuracy"], abs=1e-9)
    assert result["tokens"] == final_eval["val_tokens"]


@pytest.mark.parametrize("command", ["generate", "export-onnx"])
def test_commands_that_decode_refuse_an_encoder_before_loading_it(tmp_path, command, capsys):
    from llmstack.cli.main import main
    from llmstack.training.loading import is_masked_lm

    model_dir = tmp_path / "encoder"
    tiny_encoder().save_pretrained(model_dir)
    assert is_masked_lm(str(model_dir))
    args = {"generate": ["--prompt", "the"], "export-onnx": [str(tmp_path / "onnx")]}[command]
    target = ["--model", str(model_dir)] if command == "generate" else [str(model_dir)]
    assert main([command, *target, *args]) != 0
    err = capsys.readouterr().err
    assert "is a masked-LM encoder; this command needs a causal language model" in err
    assert "Traceback" not in err


def test_streamed_sources_are_masked_as_their_sample_numbers_say_and_resume_exactly(tmp_path, encoder_data):
    from test_trainer import write_jsonl_files

    from llmstack.data.mlm import MaskedStream, Masking
    from llmstack.data.stream import MixtureStream
    from llmstack.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(encoder_data["tokenizer"])
    sources = [{"paths": write_jsonl_files(tmp_path / "prose", "a lazy dog sleeps in the sun")}]
    masking = Masking(tokenizer.mask_token_id, len(tokenizer), 0.15, seed=3, special_ids=(0, 1, 2))

    def batches(consumed, dp_rank, dp_size, n=3):
        stream = MaskedStream(sources, tokenizer, 16, seed=0, masking=masking)
        it = stream.micro_batches(consumed, 2, dp_rank, dp_size)
        return [next(it) for _ in range(n)]

    plain = MixtureStream(sources, tokenizer, 16, seed=0).micro_batches(0, 2, 1, 2)
    blocks = [next(plain) for _ in range(3)]
    for k, batch in enumerate(batches(0, 1, 2)):  # rank 1 of 2: samples 1, 3, 5, ...
        for j, block in enumerate(blocks[k]):
            inputs, labels = masking.sample(block.numpy(), (2 * k + j) * 2 + 1)
            assert batch["input_ids"][j].tolist() == inputs.tolist()
            assert batch["labels"][j].tolist() == labels.tolist()
    uninterrupted = batches(0, 0, 1, n=4)
    resumed = batches(4, 0, 1, n=2)  # after 2 micro-batches of 2
    for a, b in zip(uninterrupted[2:], resumed):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert any((batch["labels"] != IGNORE_INDEX).any() for batch in uninterrupted)


def test_init_from_must_be_the_kind_of_model_the_objective_trains(tmp_path, encoder_data):
    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM

    tokenizer = load_tokenizer(encoder_data["tokenizer"])
    encoder = tiny_encoder(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id)
    encoder.save_pretrained(tmp_path / "encoder")
    LLMStackForCausalLM(LLMStackConfig(vocab_size=len(tokenizer), **TINY_MODEL)).save_pretrained(tmp_path / "decoder")
    for kind, objective, message in (("decoder", "mlm", "is a decoder"), ("encoder", "causal", "is an encoder")):
        raw = mlm_run_config(encoder_data, tmp_path / "run", objective=objective)
        raw["model"] = {"init_from": str(tmp_path / kind)}
        with pytest.raises(UserError, match=message):
            parse_run_config(raw)
    raw = mlm_run_config(encoder_data, tmp_path / "run")
    raw["model"] = {"init_from": str(tmp_path / "encoder")}
    parse_run_config(raw)
