"""Multi-task training: labelled JSONL, the task heads and their losses, the weightings (fixed,
uncertainty, DWA), the config's refusals, a run's per-task metrics in every sink and its exact
resume, 2 ranks equal to one process at ZeRO-3 with learned variances (test_layout_matrix: every
ZeRO stage), and a classification head's export to the stock LlamaForSequenceClassification /
EuroBertForSequenceClassification."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY_MODEL, WITHOUT_LLMSTACK, tiny_run_config

from llmstack.data.labelled import LabelledData, read_labelled
from llmstack.data.tokenizer import load_tokenizer
from llmstack.errors import UserError
from llmstack.models import LLMStackForMultitask, LLMStackMultitaskConfig
from llmstack.models.multitask import classification_loss
from llmstack.testing import run_distributed
from llmstack.training.config import parse_run_config
from llmstack.training.multitask import TaskWeighting

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()
TOPIC = {w: i % 3 for i, w in enumerate(WORDS)}  # a word's token-classification label


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sentences(n):
    return [[WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(3 + i % 6)] for i in range(n)]


@pytest.fixture(scope="module")
def task_data(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    texts = sentences(64)
    return {
        "tokenizer": tiny_data["tokenizer"],
        "lm": tiny_data["train"],
        # label: whether the text mentions the fox
        "seq": write_jsonl(root / "seq.jsonl", [{"text": " ".join(t), "label": int("fox" in t)} for t in texts]),
        "tok": write_jsonl(root / "tok.jsonl", [{"tokens": t, "labels": [TOPIC[w] for w in t]} for t in texts]),
    }


def multitask_config(task_data, out_dir, kinds=("causal_lm", "sequence_classification"), **train):
    raw = tiny_run_config({"tokenizer": task_data["tokenizer"]}, out_dir, **train)
    tasks = {
        "causal_lm": {"name": "lm", "kind": "causal_lm", "data": task_data["lm"]},
        "mlm": {"name": "mlm", "kind": "mlm", "data": task_data["lm"]},
        "sequence_classification": {
            "name": "fox",
            "kind": "sequence_classification",
            "data": task_data["seq"],
            "num_labels": 2,
        },
        "token_classification": {
            "name": "topic",
            "kind": "token_classification",
            "data": task_data["tok"],
            "num_labels": 3,
        },
    }
    raw["train"] |= {"objective": "multitask", "tasks": [dict(tasks[k]) for k in kinds], "compile": False}
    return raw


def test_labelled_batches(task_data):
    tokenizer = load_tokenizer(task_data["tokenizer"])
    seq = LabelledData([task_data["seq"]], "sequence_classification", 2, tokenizer, 32, shuffle=False)
    batch = seq.collate([seq.item(0), seq.item(1)])
    assert batch["labels"].tolist() == [r["label"] for r in seq.records[:2]]
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    tok = LabelledData([task_data["tok"]], "token_classification", 3, tokenizer, 32, shuffle=False)
    batch = tok.collate([tok.item(0)])
    words = tok.records[0]["tokens"]
    scored = batch["labels"][0][batch["labels"][0] != -100].tolist()
    assert scored == [TOPIC[w] for w in words]  # one label a word, on its first token
    assert tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()]) == " ".join(words)


def test_labelled_refusals(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 5}])
    with pytest.raises(UserError, match=r"bad.jsonl:2: labels must be integers in \[0, 2\)"):
        read_labelled([bad], "sequence_classification", 2)
    short = write_jsonl(tmp_path / "short.jsonl", [{"tokens": ["a", "b"], "labels": [0]}])
    with pytest.raises(UserError, match="short.jsonl:1: labels must be a list with one label a word"):
        read_labelled([short], "token_classification", 2)


def _train(rank, world_size, raw, ds_config_path, resume=False):
    """A Trainer run in its own process (the process group ends with it); whether it resumed."""
    from llmstack.training import Trainer

    trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config_path)
    resumed = trainer.resume("auto") if resume else False
    trainer.train()
    return resumed


def train(raw, ds_config_path, ranks=1, resume=False):
    return run_distributed(_train, ranks, args=(raw, str(ds_config_path), resume))[0]


def _ds(tmp_path, stage):
    path = tmp_path / f"zero{stage}.json"
    path.write_text(
        json.dumps(
            {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
        )
    )
    return path


def _metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if "loss" in line]


TASK_METRICS = [f"task/{n}/{m}" for n in ("lm", "fox", "topic") for m in ("loss", "weight", "accuracy")]


@pytest.fixture(scope="module")
def trained_run(task_data, tmp_path_factory):
    """4 steps of a causal LM, a sequence and a token classifier on one trunk (fixed weights, the
    token classifier's 0.5), at ZeRO-2, logged to the JSONL file, TensorBoard and W&B (offline)."""
    root = tmp_path_factory.mktemp("multitask")
    kinds = ("causal_lm", "sequence_classification", "token_classification")
    raw = multitask_config(task_data, root / "run", kinds, max_steps=4)
    raw["train"]["tasks"][2]["weight"] = 0.5
    raw["monitor"] = {"console": False, "tensorboard": True, "wandb": {"project": "llmstack-test"}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_CONFIG_DIR", str(root / "wandb-config"))
        train(raw, _ds(root, 2))
    return root / "run"


def test_every_sink_holds_each_tasks_loss_weight_and_accuracy(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_monitor_sinks import read_wandb_records

    records = _metrics(trained_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(set(TASK_METRICS) <= set(r) for r in records)
    assert all(r["task/topic/weight"] == 0.5 and r["task/lm/weight"] == 1.0 for r in records)
    # the logged total is the weighted sum of the logged task losses (one step a record)
    for r in records:
        total = r["task/lm/loss"] + r["task/fox/loss"] + 0.5 * r["task/topic/loss"]
        assert abs(r["loss"] - total) < 1e-5
    events = EventAccumulator(str(trained_run / "tensorboard"))
    events.Reload()
    for name in TASK_METRICS:
        assert [s.value for s in events.Scalars(name)] == pytest.approx([r[name] for r in records])
    (run_file,) = trained_run.glob("wandb/offline-run-*/run-*.wandb")
    logged = set()
    for record in read_wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            logged |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    assert set(TASK_METRICS) <= logged


def test_console_line_shows_each_task():
    from llmstack.monitor.console import format_summary

    line = format_summary(3, {"loss": 1.5, "task/lm/loss": 1.25, "task/lm/weight": 1.0, "task/fox/accuracy": 0.5})
    assert line == "step 3 | loss 1.5000 | lm 1.2500 w 1.00 | fox acc 50.0%"


def _dwa_runs(rank, world_size, raws, ds_config_path):
    """The whole, the stopped and the resumed run in one process (one start-up, not three)."""
    from llmstack.training import Trainer

    resumed = []
    for raw, resume in raws:
        trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config_path)
        resumed.append(trainer.resume("auto") if resume else False)
        trainer.train()
    return resumed


def test_dwa_resumes_exactly(task_data, tmp_path):
    """A DWA run stopped after 2 steps and resumed trains steps 3-4 as the uninterrupted run does:
    the loss history that sets steps 3 and 4's weights comes back from the checkpoint."""

    def config(out, max_steps):
        raw = multitask_config(task_data, out, max_steps=max_steps, save_interval=2, task_weighting="dwa")
        raw["train"].update(warmup_steps=0, min_lr=raw["train"]["lr"])  # the same schedule for 2 and 4 steps
        return raw

    runs = [(config(tmp_path / "whole", 4), False), (config(tmp_path / "split", 2), False)]
    runs.append((config(tmp_path / "split", 4), True))
    assert run_distributed(_dwa_runs, 1, args=(runs, str(_ds(tmp_path, 1))))[0] == [False, False, True]
    whole, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "split")
    assert [r["step"] for r in resumed[-2:]] == [3, 4]
    for mine, theirs in zip(resumed[-2:], whole[-2:]):
        for key in ("loss", "task/lm/weight", "task/fox/weight", "task/fox/loss"):
            assert abs(mine[key] - theirs[key]) < 1e-6, (key, mine[key], theirs[key])
    assert whole[-1]["task/lm/weight"] != 1.0  # DWA moved the weights


def test_two_ranks_equal_one_process_with_learned_variances_at_zero3(task_data, tmp_path):
    """A causal LM, a sequence and a token classifier under uncertainty weighting: 2 ranks of 2
    samples a task at ZeRO-3 (the log-variances partitioned with the rest) train as one process of
    4, each task's loss normalised by the step's targets over both ranks. The bound is the issue's
    1e-5; measured 1.4e-6 at most over the 3 steps (one run, loaded 2-core CPU). The layout matrix
    checks fixed weights at every stage, with activation checkpointing and bf16."""
    kinds = ("causal_lm", "sequence_classification", "token_classification")

    def losses(out, ranks, stage):
        raw = multitask_config(task_data, out, kinds, max_steps=3, task_weighting="uncertainty")
        raw["train"]["micro_batch_size"] = 4 // ranks
        train(raw, _ds(tmp_path, stage), ranks=ranks)
        records = _metrics(out)
        return [
            [r[k] for k in ("loss", *(f"task/{n}/{m}" for n in ("lm", "fox", "topic") for m in ("loss", "weight")))]
            for r in records
        ]

    one, two = losses(tmp_path / "one", 1, 0), losses(tmp_path / "two", 2, 3)
    assert len(two) == 3
    difference = max(abs(x - y) for a, b in zip(one, two) for x, y in zip(a, b))
    assert difference < 1e-5, (one, two)
    assert two[-1][2] != 1.0  # the learned variances moved the weights


STOCK_SCRIPT = (
    WITHOUT_LLMSTACK
    + """
import json, sys

import torch
from transformers import AutoModelForSequenceClassification
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval()
batch = {k: torch.tensor(v) for k, v in json.loads(sys.argv[2]).items()}
with torch.no_grad():
    print(json.dumps({"class": type(model).__name__, "logits": model(**batch).logits.tolist()}))
"""
)


def stock_logits(directory, batch):
    """A stock sequence classifier's logits, in a process that cannot import llmstack."""
    arguments = json.dumps({k: v.tolist() for k, v in batch.items() if k != "labels"})
    result = subprocess.run(
        [sys.executable, "-c", STOCK_SCRIPT, str(directory), arguments], capture_output=True, text=True, check=True
    )
    shown = json.loads(result.stdout)
    return shown["class"], torch.tensor(shown["logits"])


def test_classifier_of_a_checkpoint_exports_to_stock_llama(trained_run, task_data, tmp_path):
    """`llmstack export-hf --format llama --task fox` of a ZeRO-2 checkpoint: stock
    LlamaForSequenceClassification's logits equal the multi-task model's within 1e-5 on a padded batch."""
    from llmstack.training.export import load_trained_model

    out = tmp_path / "fox"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llmstack",
            "export-hf",
            str(trained_run / "checkpoints"),
            str(out),
            "--format",
            "llama",
            "--task",
            "fox",
        ],
        check=True,
        capture_output=True,
    )
    tokenizer = load_tokenizer(task_data["tokenizer"])
    data = LabelledData([task_data["seq"]], "sequence_classification", 2, tokenizer, 32, shuffle=False)
    batch = data.collate([data.item(i) for i in range(4)])
    assert not batch["attention_mask"].all()  # padded: the last real token is pooled
    model = load_trained_model(str(trained_run / "checkpoints"))
    with torch.no_grad():
        ours = model(tasks={"fox": batch, **other_task_batches(model)}).logits["fox"]
    name, theirs = stock_logits(out, batch)
    assert name == "LlamaForSequenceClassification"
    assert (ours - theirs).abs().max() < 1e-5


def other_task_batches(model):
    """A dummy batch of every task but the classifier "fox" (the forward pass computes them all)."""
    ids = torch.tensor([[5, 6, 7]])
    batches = {}
    for task in model.config.tasks:
        if task["kind"] == "causal_lm" or task["kind"] == "mlm":
            batches[task["name"]] = {"input_ids": ids, "labels": ids}
        elif task["name"] != "fox":
            batches[task["name"]] = {"input_ids": ids, "labels": torch.zeros_like(ids)}
    return batches


def test_encoder_classifier_exports_to_stock_eurobert(task_data, tmp_path):
    """A masked-LM + sequence-classification model (bidirectional trunk, head on the first token)
    saved, exported with --format eurobert: EuroBertForSequenceClassification's logits equal ours."""
    from llmstack.training.export import export_hf

    tokenizer = load_tokenizer(task_data["tokenizer"])
    tasks = [{"name": "mlm", "kind": "mlm"}, {"name": "fox", "kind": "sequence_classification", "num_labels": 2}]
    torch.manual_seed(0)
    config = LLMStackMultitaskConfig(
        tasks=tasks, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, mask_token_id=3, **TINY_MODEL
    )
    model = LLMStackForMultitask(config).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    export_hf(str(tmp_path / "model"), str(tmp_path / "out"), "eurobert", task="fox")
    data = LabelledData([task_data["seq"]], "sequence_classification", 2, tokenizer, 32, shuffle=False)
    batch = data.collate([data.item(i) for i in range(4)])
    with torch.no_grad():
        ours = model(tasks={"fox": batch, **other_task_batches(model)}).logits["fox"]
    name, theirs = stock_logits(tmp_path / "out", batch)
    assert name == "EuroBertForSequenceClassification"
    assert (ours - theirs).abs().max() < 1e-5


def tiny_multitask(learn_task_variance=False, kinds=("causal_lm", "sequence_classification")):
    tasks = [{"name": "lm", "kind": kinds[0]}, {"name": "fox", "kind": kinds[1], "num_labels": 3}]
    torch.manual_seed(0)
    config = LLMStackMultitaskConfig(
        tasks=tasks, learn_task_variance=learn_task_variance, vocab_size=64, pad_token_id=0, **TINY_MODEL
    )
    return LLMStackForMultitask(config)


def test_total_is_the_weighted_sum_and_uncertainty_weighs_by_learned_variance():
    """Fixed weights: sum w_i L_i. Learned variances s_i: sum w_i (exp(-s_i) L_i + s_i / 2), whose
    gradient in s_i is w_i (1/2 - exp(-s_i) L_i)."""
    ids = torch.randint(1, 64, (2, 6))
    batches = {"lm": {"input_ids": ids, "labels": ids}, "fox": {"input_ids": ids, "labels": torch.tensor([0, 2])}}
    fixed = tiny_multitask()(tasks=batches, task_weights=[1.0, 0.5])
    assert torch.allclose(fixed.loss, fixed.task_losses[0] + 0.5 * fixed.task_losses[1])
    model = tiny_multitask(learn_task_variance=True)
    with torch.no_grad():
        model.task_log_variance.copy_(torch.tensor([0.3, -0.2]))
    out = model(tasks=batches, task_weights=[1.0, 0.5])
    s, losses, w = model.task_log_variance.detach(), out.task_losses, torch.tensor([1.0, 0.5])
    assert torch.allclose(out.loss, (w * (torch.exp(-s) * losses + s / 2)).sum())
    assert torch.allclose(out.task_weights, w * torch.exp(-s))
    out.loss.backward()
    assert torch.allclose(model.task_log_variance.grad, w * (0.5 - torch.exp(-s) * losses))


def test_classification_loss_skips_ignored_labels():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]]])
    labels = torch.tensor([[0, 0, -100]])
    loss, correct, scored = classification_loss(logits, labels)
    expected = torch.nn.functional.cross_entropy(logits[0, :2], labels[0, :2])
    assert torch.allclose(loss, expected) and int(correct) == 1 and int(scored) == 2


def test_dwa_weights_follow_the_loss_ratios():
    """w_i = K x base_i x softmax_i(r_i / T), r_i the ratio of the last two step losses; 1 x base before."""
    weighting = TaskWeighting("dwa", [1.0, 2.0], temperature=2.0)
    assert weighting.weights() == [1.0, 2.0]
    weighting.update([4.0, 1.0])
    assert weighting.weights() == [1.0, 2.0]
    weighting.update([2.0, 1.0])  # task 0 fell by half, task 1 stayed: task 1 weighs more
    e0, e1 = torch.exp(torch.tensor(0.5 / 2)), torch.exp(torch.tensor(1.0 / 2))
    expected = [2 * 1.0 * e0 / (e0 + e1), 2 * 2.0 * e1 / (e0 + e1)]
    assert weighting.weights() == pytest.approx([float(x) for x in expected])
    restored = TaskWeighting("dwa", [1.0, 2.0], temperature=2.0)
    restored.load_state_dict(json.loads(json.dumps(weighting.state_dict())))
    assert restored.weights() == weighting.weights()
    fixed = TaskWeighting("fixed", [1.0, 2.0])
    fixed.update([1.0, 1.0])
    fixed.update([9.0, 1.0])
    assert fixed.weights() == [1.0, 2.0]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tasks": []}, "train.tasks must be a list"),
        ({"task_weighting": "gradnorm"}, "train.task_weighting must be one of fixed, uncertainty, dwa"),
        ({"tasks": [{"name": "a b", "kind": "causal_lm", "data": "x"}]}, r"train.tasks\[0\].name must be a name"),
        ({"tasks": [{"name": "a", "kind": "regression", "data": "x"}]}, r"kind must be one of causal_lm, mlm"),
        (
            {"tasks": [{"name": "a", "kind": "causal_lm", "data": "x", "head": 1}]},
            r"unknown key\(s\) train.tasks\[0\].head",
        ),
        ({"tasks": [{"name": "a", "kind": "causal_lm", "data": "x", "weight": 0}]}, "weight must be a positive number"),
        (
            {"tasks": [{"name": "a", "kind": "causal_lm", "data": "x"}, {"name": "a", "kind": "mlm", "data": "x"}]},
            "unique",
        ),
        (
            {"tasks": [{"name": "a", "kind": "causal_lm", "data": "x"}, {"name": "b", "kind": "mlm", "data": "x"}]},
            "bidirectional",
        ),
        ({"tasks": [{"name": "a", "kind": "sequence_classification", "data": "x"}]}, "num_labels must be an integer"),
        (
            {"tasks": [{"name": "a", "kind": "sequence_classification", "data": "missing.jsonl", "num_labels": 2}]},
            "not found",
        ),
    ],
)
def test_config_refusals(task_data, tmp_path, change, message):
    raw = multitask_config(task_data, tmp_path)
    raw["train"].update(change)
    with pytest.raises(UserError, match=message):
        parse_run_config(raw)


def test_layout_refuses_model_parallelism(task_data, tmp_path):
    from llmstack.parallel.layout import check_layout
    from llmstack.training.config import run_layout

    raw = multitask_config(task_data, tmp_path, tensor_parallel_size=2)
    with pytest.raises(UserError, match="a multi-task model with tensor, pipeline or context parallelism"):
        check_layout(run_layout(parse_run_config(raw), {"zero_optimization": {"stage": 1}}))
    raw = multitask_config(task_data, tmp_path, compile="auto", max_steps=100_000)  # auto: eager
    check_layout(run_layout(parse_run_config(raw), {"zero_optimization": {"stage": 3}}))
