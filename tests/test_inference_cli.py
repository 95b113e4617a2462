import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from inference_fixtures import tiny_model, tiny_tokenizer

from llmstack import to_llama
from llmstack.cli.main import main
from llmstack.data.blocks import PackedBlocks
from llmstack.data.indexed import IndexedDatasetWriter
from llmstack.inference import GREEDY, generate_text
from llmstack.training.evaluate import evaluate_perplexity
from llmstack.training.finetune.lora import add_lora


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    tokenizer = tiny_tokenizer(root / "model")
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_generate_streams_one_prompt(model_dir, tokenizer, capsys):
    expected = generate_text(tiny_model(vocab_size=len(tokenizer)), tokenizer, ["def add"], max_new_tokens=16)[0]
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                "def add",
                "--temperature",
                "0",
                "--max-new-tokens",
                "16",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "def add" + expected + "\n"


def test_generate_a_seeded_batch_reproducibly_from_a_llama_export(model_dir, tokenizer, tmp_path, capsys):
    to_llama(tiny_model(vocab_size=len(tokenizer))).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = [
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "The quick",
        "--prompt",
        "class Stack:",
        "--seed",
        "3",
        "--top-p",
        "0.9",
        "--stop",
        "\n\n",
        "--max-new-tokens",
        "24",
    ]
    outputs = []
    for _ in range(2):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith("The quick") and "\n\nclass Stack:" in outputs[0]


def test_eval_reports_perplexity_and_the_exact_token_count(model_dir, tmp_path, capsys):
    prefix = str(tmp_path / "valid")
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document(np.random.default_rng(0).integers(2, 300, 200))
    assert main(["eval", "--model", str(model_dir), "--data", prefix, "--seq-len", "32", "--batch-size", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == (199 // 32) * 32 == result["blocks"] * 32
    blocks = PackedBlocks(prefix, 32, shuffle=False)
    expected = evaluate_perplexity(tiny_model(vocab_size=320), blocks.eval_batches(100, 2, 0, 1))
    assert result["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)


def test_merge_lora_writes_a_plain_model_that_generates(model_dir, tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    adapted = add_lora(tiny_model(vocab_size=len(tokenizer)), rank=4, dropout=0.0)
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    argv = [
        "merge-lora",
        "--base",
        str(model_dir),
        "--adapter",
        str(tmp_path / "adapter"),
        "--out",
        str(tmp_path / "m"),
    ]
    assert main(argv) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    options = dict(max_new_tokens=10, sampling=GREEDY)
    assert generate_text(merged, tokenizer, ["def"], **options) == generate_text(
        adapted.eval(), tokenizer, ["def"], **options
    )


def test_a_missing_model_is_a_user_error_exit_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "not found" in capsys.readouterr().err


def greedy_text(tokenizer, prompt, max_new_tokens):
    return generate_text(tiny_model(vocab_size=len(tokenizer)), tokenizer, [prompt], max_new_tokens=max_new_tokens)[0]


def test_a_streamed_prompt_is_cut_before_its_stop_string(model_dir, tokenizer, capsys):
    full = greedy_text(tokenizer, "def add", 24)
    stop = next(
        full[i : i + 2] for i in range(4, len(full)) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "def add",
        "--temperature",
        "0",
        "--max-new-tokens",
        "24",
    ]
    assert main([*argv, "--stop", stop]) == 0
    assert capsys.readouterr().out == "def add" + full[: full.find(stop)] + "\n"


def test_generate_jsonl_gives_one_object_per_prompt(model_dir, tokenizer, capsys):
    prompts = ["The quick", "class Stack:", "def add"]
    argv = ["generate", "--model", str(model_dir), "--temperature", "0", "--max-new-tokens", "12", "--output", "jsonl"]
    assert main([*argv, *(a for p in prompts for a in ("--prompt", p))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"prompt": p, "completion": greedy_text(tokenizer, p, 12)} for p in prompts
    ]


@pytest.fixture
def loading_logs_to_stdout(monkeypatch):
    """Loading a training checkpoint imports DeepSpeed, whose logger gets a handler on the stdout
    of that moment, and zero_to_fp32 prints: do both while the model loads."""
    import logging
    import sys

    import llmstack.training.loading as loading

    real_load = loading.load_model_and_tokenizer

    def noisy_load(*args, **kwargs):
        logger = logging.getLogger("fake_deepspeed")
        logger.addHandler(logging.StreamHandler(stream=sys.stdout))
        logger.warning("Setting accelerator to CPU.")
        print("Processing zero checkpoint")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model_and_tokenizer", noisy_load)


def test_eval_and_generate_keep_stdout_for_the_result(model_dir, tmp_path, capsys, loading_logs_to_stdout):
    prefix = str(tmp_path / "valid")
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document(np.random.default_rng(0).integers(2, 300, 100))
    assert main(["eval", "--model", str(model_dir), "--data", prefix, "--seq-len", "32"]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)) >= {"perplexity", "tokens"}
    assert "Setting accelerator" in captured.err and "Processing zero" in captured.err
    assert (
        main(["generate", "--model", str(model_dir), "--prompt", "x", "--output", "jsonl", "--max-new-tokens", "2"])
        == 0
    )
    assert list(json.loads(capsys.readouterr().out)) == ["prompt", "completion"]


def test_eval_and_generate_in_a_fresh_process_print_only_their_result(model_dir, tmp_path):
    """In a new interpreter DeepSpeed's logger binds the stdout of its import; the result must
    still be alone on stdout (the test above imports DeepSpeed before faking its logs)."""
    prefix = str(tmp_path / "valid")
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document(np.random.default_rng(0).integers(2, 300, 100))
    generate = ["generate", "--model", str(model_dir), "--prompt", "x", "--output", "jsonl", "--max-new-tokens", "2"]
    evaluate = ["eval", "--model", str(model_dir), "--data", prefix, "--seq-len", "32"]
    for command, keys in ((generate, {"prompt", "completion"}), (evaluate, {"perplexity", "tokens"})):
        out = subprocess.run([sys.executable, "-m", "llmstack", *command], capture_output=True, text=True, check=True)
        lines = out.stdout.splitlines()
        assert len(lines) == 1 and set(json.loads(lines[0])) >= keys
