"""Contrastive embedding models: pooling, InfoNCE by hand, the gather across 2 ranks equal to one
process (losses and gradients), the MoCo queue and its resume, a SimCSE run, the refusals, export
to sentence-transformers and retrieval recall."""

import json
import math
import os

import pytest
import torch
from conftest import TINY_MODEL, WITHOUT_LLMSTACK, tiny_run_config

from llmstack.data.pairs import PairData, read_pairs, split_pairs
from llmstack.errors import UserError
from llmstack.models import LLMStackEmbeddingConfig, LLMStackForEmbedding
from llmstack.models.embedding import pool
from llmstack.testing import run_distributed
from llmstack.training.config import parse_run_config
from llmstack.training.contrastive import info_nce, retrieval_recall, unit
from llmstack.training.momentum import MomentumEncoder

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def pair_records(n, offset=0):
    """Pairs whose positive shares the query's words in another order, a word added."""
    records = []
    for i in range(offset, offset + n):
        words = [WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(3 + i % 5)]
        records.append({"query": " ".join(words), "positive": " ".join([*reversed(words), WORDS[i % len(WORDS)]])})
    return records


@pytest.fixture(scope="module")
def pairs_data(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {
        "tokenizer": tiny_data["tokenizer"],
        "train": [write_jsonl(root / "train.jsonl", pair_records(64))],
        "valid": [write_jsonl(root / "valid.jsonl", pair_records(24, offset=100))],
        "texts": [write_jsonl(root / "texts.jsonl", [{"text": r["query"]} for r in pair_records(64)])],
    }


def contrastive_config(pairs_data, out_dir, **train):
    raw = tiny_run_config({k: pairs_data[k] for k in ("tokenizer", "train", "valid")}, out_dir, **train)
    raw["train"]["objective"] = "contrastive"
    return raw


def tiny_embedder(pooling="mean", **overrides):
    torch.manual_seed(0)
    return LLMStackForEmbedding(LLMStackEmbeddingConfig(pooling=pooling, vocab_size=256, **TINY_MODEL, **overrides))


def test_pooling_mean_and_last_token_skip_padding():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(pool(hidden, mask, "mean"), torch.stack([hidden[0, :2].mean(0), hidden[1].mean(0)]))
    assert torch.equal(pool(hidden, mask, "last"), torch.stack([hidden[0, 1], hidden[1, 2]]))


def test_padding_leaves_embeddings_unchanged():
    """Right padding changes neither pooling's embedding of a text (causal trunk, masked pooling)."""
    for pooling in ("mean", "last"):
        model = tiny_embedder(pooling).eval()
        ids = torch.tensor([[5, 6, 7]])
        padded = torch.tensor([[5, 6, 7, 1, 1]])
        alone = model(ids, torch.ones_like(ids)).embeddings
        batched = model(padded, torch.tensor([[1, 1, 1, 0, 0]])).embeddings
        torch.testing.assert_close(alone, batched, atol=1e-6, rtol=0)


def test_info_nce_equals_hand_computation():
    torch.manual_seed(0)
    q, k, queue = (unit(torch.randn(n, 4)) for n in (2, 4, 3))
    temperature = 0.1
    loss = info_nce(q, k, temperature, first_positive=2, negatives=queue)
    expected = 0.0
    for i in range(2):
        logits = [float(q[i] @ key) / temperature for key in [*k, *queue]]
        expected += -(logits[2 + i] - math.log(sum(math.exp(x) for x in logits)))
    assert abs(loss.item() - expected / 2) < 1e-5


def _loss_and_grads(model, batch, rank=0):
    """InfoNCE of a pair batch, the keys gathered over the process group (when there is one)."""
    from llmstack.parallel.batch_gather import gather_batch

    model.zero_grad()
    embeddings = unit(model(**batch).embeddings)
    queries, keys = embeddings.chunk(2)
    loss = info_nce(queries, gather_batch(keys), 0.05, rank * queries.shape[0])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _two_rank_gradients(rank, world_size, batches):
    import torch.distributed as dist

    model = tiny_embedder()
    loss, grads = _loss_and_grads(model, batches[rank], rank)
    dist.all_reduce(loss)  # the mean over ranks, as DeepSpeed averages the gradients
    for g in grads.values():
        dist.all_reduce(g)
    return loss / world_size, {n: g / world_size for n, g in grads.items()}


def test_gather_two_ranks_equal_one_process(pairs_data):
    """Each rank's queries against every rank's positives, gradients through the gather: the
    mean of the ranks' losses and gradients is one process's on the whole global batch (8 pairs).
    The bound is the issue's 1e-5. Measured on this batch and the next two (loaded 2-core CPU):
    losses 0 to 4.8e-7 apart, gradients (largest element difference) 2.9e-6 to 4.3e-6."""
    from llmstack.data.tokenizer import load_tokenizer

    data = PairData(pairs_data["train"], load_tokenizer(pairs_data["tokenizer"]), 16, shuffle=False)
    whole = next(data.micro_batches(0, 8, 0, 1))
    halves = [next(data.micro_batches(0, 4, r, 2)) for r in range(2)]
    loss, grads = _loss_and_grads(tiny_embedder(), whole)
    results = run_distributed(_two_rank_gradients, 2, args=(halves,))
    for two_loss, two_grads in results:
        assert abs(two_loss.item() - loss.item()) < 1e-5
        for name, g in grads.items():
            assert (two_grads[name] - g).abs().max() < 1e-5, name
        assert max(g.abs().max() for g in grads.values()) > 1e-3  # gradients that mean something


def test_pair_batches_hold_queries_then_positives(pairs_data):
    from llmstack.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(pairs_data["tokenizer"])
    data = PairData(pairs_data["train"], tokenizer, 16, shuffle=False)
    queries, positives = split_pairs(next(data.micro_batches(0, 3, 0, 1)))
    assert queries["input_ids"].shape[0] == positives["input_ids"].shape[0] == 3
    first = tokenizer.decode(queries["input_ids"][0][queries["attention_mask"][0].bool()])
    assert first.strip() == data.pairs[0][0]


def test_pairs_files_are_checked(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"query": "a", "positive": "b"}, {"query": "only"}])
    with pytest.raises(UserError, match="bad.jsonl:2"):
        read_pairs([bad])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"query": "a", "positive": "b"}, {"text": "c"}])
    with pytest.raises(UserError, match="mix"):
        read_pairs([mixed])
    assert read_pairs([write_jsonl(tmp_path / "t.jsonl", [{"text": "c"}])]) == ([("c", "c")], True)


def test_momentum_queue_wraps_and_follows_the_model():
    model = tiny_embedder()
    momentum = MomentumEncoder(model, queue_size=5, momentum=0.9, seed=1)
    assert torch.allclose(momentum.queue.norm(dim=-1), torch.ones(5))
    keys = [unit(torch.randn(3, TINY_MODEL["hidden_size"])) for _ in range(2)]
    for k in keys:
        momentum.enqueue(k)
    assert momentum.pointer == 1
    # rows 0-2 took the first keys, rows 3, 4 and (wrapping) 0 the second
    assert torch.equal(momentum.queue[3:5], keys[1][:2]) and torch.equal(momentum.queue[0], keys[1][2])
    assert torch.equal(momentum.queue[1:3], keys[0][1:])  # the oldest still there
    before = [p.clone() for p in momentum.encoder.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    momentum.update(model.parameters())
    for b, k, q in zip(before, momentum.encoder.parameters(), model.parameters()):
        torch.testing.assert_close(k, 0.9 * b + 0.1 * q)
    restored = MomentumEncoder(tiny_embedder(), queue_size=5, momentum=0.9, seed=2)
    restored.load_state_dict(momentum.state_dict())
    assert torch.equal(restored.queue, momentum.queue) and restored.pointer == momentum.pointer
    for a, b in zip(restored.encoder.parameters(), momentum.encoder.parameters()):
        assert torch.equal(a, b)


def test_retrieval_recall_on_a_separable_set(pairs_data):
    """Each query's positive is the query itself: recall 1 with any model; shifted, 0 at k=1."""
    model = tiny_embedder().eval()
    texts = [torch.tensor([[3 + i, 4 + i, 5 + i]]) for i in range(12)]
    same = [{"input_ids": torch.cat([t, t]), "attention_mask": torch.ones(2, 3, dtype=torch.long)} for t in texts]
    result = retrieval_recall(lambda b: model(**b).embeddings, same)
    assert result["recall@1"] == result["recall@10"] == 1.0 and result["pairs"] == 12


def test_contrastive_config_refusals(pairs_data, tmp_path):
    def parse(**changes):
        raw = contrastive_config(pairs_data, tmp_path)
        for key, value in changes.items():
            section, name = key.split("__")
            raw[section][name] = value
        return parse_run_config(raw)

    with pytest.raises(UserError, match="train.pooling"):
        parse(train__pooling="max")
    with pytest.raises(UserError, match="JSONL"):
        parse(data__train=["some/prefix"])
    with pytest.raises(UserError, match="hidden_dropout"):
        parse(data__train=pairs_data["texts"])
    with pytest.raises(UserError, match="temperature"):
        parse(train__temperature=0)
    from llmstack.parallel.layout import check_layout
    from llmstack.training.config import run_layout

    for key, size in (("tensor", 2), ("pipeline", 2), ("context", 2)):
        run = parse(**{f"train__{key}_parallel_size": size})
        with pytest.raises(UserError, match=f"contrastive embedding model with {key} parallelism"):
            check_layout(run_layout(run, {"zero_optimization": {"stage": 1}}))
    run = parse(train__queue_size=16)
    with pytest.raises(UserError, match="MoCo queue with ZeRO stage 3"):
        check_layout(run_layout(run, {"zero_optimization": {"stage": 3}}))


def test_simcse_copies_differ_by_dropout_only():
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    for dropout, differ in ((0.1, True), (0.0, False)):
        model = tiny_embedder(hidden_dropout=dropout).train()
        first, second = model(ids, torch.ones_like(ids)).embeddings
        assert (not torch.allclose(first, second)) == differ


def test_simcse_run(pairs_data, tmp_path):
    """Unsupervised: each text twice through dropout, 6 steps of 8 texts through the Trainer,
    with held-out pairs' recall logged."""
    raw = contrastive_config(pairs_data, tmp_path / "run", max_steps=6, micro_batch_size=8)
    raw["data"]["train"] = pairs_data["texts"]
    raw["model"]["hidden_dropout"] = 0.1
    train(raw, _ds(tmp_path, 0))
    records = _metrics(tmp_path / "run")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(0 < loss < math.log(8) for loss in losses), losses
    recall = [r for r in records if "val_recall@1" in r]
    assert len(recall) == 2 and 0.0 <= recall[-1]["val_recall@1"] <= recall[-1]["val_recall@10"] <= 1.0


def _train(rank, world_size, raw, ds_config_path, resume=False):
    """A Trainer run in its own process (the process group ends with it); whether it resumed."""
    from llmstack.training import Trainer

    trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config_path)
    resumed = trainer.resume("auto") if resume else False
    trainer.train()
    return resumed


def train(raw, ds_config_path, resume=False):
    return run_distributed(_train, 1, args=(raw, str(ds_config_path), resume))[0]


def _ds(tmp_path, stage):
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return path


def _metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


ST_SCRIPT = (
    WITHOUT_LLMSTACK
    + """
import json, sys

from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")
print(json.dumps(model.encode(json.loads(sys.argv[2]), convert_to_tensor=True).tolist()))
"""
)


@pytest.fixture(scope="module")
def trained_embedder(pairs_data, tmp_path_factory):
    """4 steps of last-token pooling on pairs at ZeRO-2 (the export reassembles its shards)."""
    root = tmp_path_factory.mktemp("embedder")
    raw = contrastive_config(pairs_data, root / "run", max_steps=4, micro_batch_size=8)
    raw["train"]["pooling"] = "last"
    train(raw, _ds(root, 2))
    return root / "run" / "checkpoints"


def test_sentence_transformers_export_equals_llmstack(trained_embedder, tmp_path):
    """SentenceTransformer(path), in a process that cannot import llmstack, embeds texts as
    llmstack does (fp32)."""
    pytest.importorskip("sentence_transformers")
    import subprocess
    import sys

    from llmstack.data.pairs import tokenize_texts
    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.training.export import load_trained_model

    out = tmp_path / "st"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llmstack",
            "export-hf",
            str(trained_embedder),
            str(out),
            "--format",
            "sentence-transformers",
        ],
        check=True,
        capture_output=True,
    )
    texts = ["the quick brown fox", "seven wizards quietly hex bold jugglers", "a dog"]
    shown = subprocess.run(
        [sys.executable, "-c", ST_SCRIPT, str(out), json.dumps(texts)], check=True, capture_output=True, text=True
    )
    exported = torch.tensor(json.loads(shown.stdout.strip().splitlines()[-1]))
    model = load_trained_model(str(trained_embedder))
    with torch.no_grad():
        ours = model.embed(**tokenize_texts(load_tokenizer(str(trained_embedder)), texts, 1024))
    assert (exported - ours).abs().max() < 1e-5


def test_eval_reports_recall_on_held_out_pairs(trained_embedder, pairs_data, tmp_path):
    import subprocess
    import sys

    same = write_jsonl(
        tmp_path / "same.jsonl", [{"query": r["query"], "positive": r["query"]} for r in pair_records(20)]
    )
    for pairs, perfect in ((pairs_data["valid"][0], False), (same, True)):
        shown = subprocess.run(
            [sys.executable, "-m", "llmstack", "eval", "--model", str(trained_embedder), "--pairs", pairs],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(shown.stdout)
        assert 0.0 <= result["recall@1"] <= result["recall@10"] <= 1.0
        if perfect:  # every query is its own positive (no two queries alike)
            assert result["recall@1"] == 1.0 and result["pairs"] == 20


def test_moco_queue_of_65536_resumes_exactly(pairs_data, tmp_path):
    """A MoCo run (queue of 65,536 keys) stopped after 2 steps and resumed trains steps 3-4 as the
    uninterrupted run does: the key encoder and queue come back from the checkpoint."""

    def run(out, max_steps, resume=False):
        raw = contrastive_config(pairs_data, out, max_steps=max_steps, micro_batch_size=8, save_interval=2)
        # a constant learning rate: the 2-step run's schedule is then the 4-step run's
        raw["train"].update(queue_size=65536, momentum=0.9, warmup_steps=0, min_lr=raw["train"]["lr"])
        assert train(raw, _ds(tmp_path, 1), resume) == resume
        return [r["loss"] for r in _metrics(out) if "loss" in r]

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "split", 2)
    resumed = run(tmp_path / "split", 4, resume=True)
    assert len(whole) == 4 and abs(resumed[-1] - whole[-1]) < 1e-5 and abs(resumed[-2] - whole[-2]) < 1e-5
    assert os.path.isfile(tmp_path / "whole" / "checkpoints" / "global_step4" / "momentum.pt")
