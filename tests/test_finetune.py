"""`llmstack finetune` through the DeepSpeed trainer on 2 ranks: LoRA, full and prompt tuning in one launch."""

import json

import pytest
import torch
import yaml
from inference_fixtures import tiny_model, tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmstack.inference import generate_text
from llmstack.testing import run_distributed
from llmstack.training.export import consolidated_state_dict
from llmstack.training.finetune.lora import merge_lora

PAIRS = [
    {"question": "Q: add(a, b)?\nA:", "answer": " return a + b"},
    {"question": "Q: the fox?\nA:", "answer": " quick brown"},
    {"question": "Q: stack?\nA:", "answer": " push item"},
    {"question": "Q: the dog?\nA:", "answer": " lazy"},
]
METHODS = {"lora": ("zero2", 2e-2), "full": ("zero3", 3e-3), "prompt": ("zero1", 1e-1)}


def finetune_each_method(rank, world_size, root):
    from llmstack.cli.main import main

    for method, (ds_config, _) in METHODS.items():
        argv = [
            "finetune",
            "--config",
            f"{root}/{method}.yaml",
            "--base-model",
            f"{root}/base",
            "--method",
            method,
            "--lora-dropout",
            "0",
            "--num-virtual-tokens",
            "4",
            "--prompt-field",
            "question",
            "--response-field",
            "answer",
            "--ds-config",
            f"ds_configs/{ds_config}.json",
        ]
        assert main(argv) == 0


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = tiny_tokenizer(root / "base")
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(root / "base")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    for method, (_, lr) in METHODS.items():
        run = {
            "data": {"train": str(root / "pairs.jsonl"), "valid": str(root / "pairs.jsonl"), "seq_len": 32},
            "train": {
                "out_dir": str(root / method),
                "micro_batch_size": 2,
                "max_steps": 40,
                "lr": lr,
                "min_lr": lr / 10,
                "warmup_steps": 1,
                "weight_decay": 0.0,
                "log_interval": 1,
                "eval_interval": 40,
                "eval_samples": 4,
                "save_interval": 40,
            },
            "monitor": {"console": False},
        }
        (root / f"{method}.yaml").write_text(yaml.safe_dump(run))
    run_distributed(finetune_each_method, 2, args=(str(root),))
    return root


def metrics(root, method):
    with open(root / method / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def answers(model, tokenizer):
    return generate_text(model.eval(), tokenizer, [p["question"] for p in PAIRS], max_new_tokens=10)


@pytest.mark.parametrize("method", METHODS)
def test_the_loss_falls_and_the_validation_scores_only_the_answers(finetuned, method):
    records = metrics(finetuned, method)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 40 and losses[-1] < 0.5 * losses[0]
    tokenizer = AutoTokenizer.from_pretrained(finetuned / "base")
    answer_tokens = sum(len(tokenizer(p["answer"])["input_ids"]) + 1 for p in PAIRS)  # + EOS
    assert [r["val_tokens"] for r in records if "val_tokens" in r] == [answer_tokens, answer_tokens]


def test_lora_saves_only_the_adapter_leaves_the_base_untouched_and_merges(finetuned):
    adapter = load_file(finetuned / "lora" / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    # The DeepSpeed checkpoint holds the trained module: its frozen base weights are the base model's.
    trained = consolidated_state_dict(str(finetuned / "lora" / "checkpoints"))
    base = load_file(finetuned / "base" / "model.safetensors")
    frozen = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in trained.items() if "lora_" not in k
    }
    assert all(torch.equal(frozen[k], v) for k, v in base.items())
    merge_lora(finetuned / "base", finetuned / "lora" / "adapter", finetuned / "merged")
    tokenizer = AutoTokenizer.from_pretrained(finetuned / "merged")
    assert answers(AutoModelForCausalLM.from_pretrained(finetuned / "merged"), tokenizer) == [
        p["answer"] for p in PAIRS
    ]


def test_full_fine_tuning_saves_a_model_that_answers(finetuned):
    model_dir = finetuned / "full" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert answers(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer) == [p["answer"] for p in PAIRS]


def test_prompt_tuning_saves_only_the_soft_prompt(finetuned):
    adapter = load_file(finetuned / "prompt" / "adapter" / "adapter_model.safetensors")
    assert list(adapter) == ["prompt_embeddings"] and adapter["prompt_embeddings"].shape[0] == 4
