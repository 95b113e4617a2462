"""The quickstart end to end at toy size: own data, deepspeed launcher on 2 ranks, export, sample."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llmstack.data.stdlib_corpus import stdlib_docstrings


def test_quickstart_on_user_data_through_the_deepspeed_launcher(tmp_path):
    docs = stdlib_docstrings()[:330]
    for split, part in (("train", docs[:300]), ("valid", docs[300:])):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"body": doc}) + "\n" for doc in part)
    out = tmp_path / "run"
    overrides = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "data.seq_len=32",
        "train.max_steps=8",
        "train.warmup_steps=2",
        "train.lr=5e-3",
        "train.log_interval=4",
        "train.eval_interval=8",
        "train.eval_samples=16",
        "train.micro_batch_size=4",
        "monitor.console=false",
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmstack",
            "quickstart",
            "--out",
            str(out),
            "--vocab-size",
            "300",
            "--data",
            str(tmp_path / "train.jsonl"),
            "--valid",
            str(tmp_path / "valid.jsonl"),
            "--text-field",
            "body",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "validation loss" in result.stdout and "== 7/7 sample" in result.stdout

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert isinstance(model, LlamaForCausalLM)  # stock transformers, no llmstack classes
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0]
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
