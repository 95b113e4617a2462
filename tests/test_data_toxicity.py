"""The toxicity stage: a classifier the test trains itself (a tiny Hugging Face sequence
classifier), per-label thresholds, drops counted by reason; the English wheel model when installed."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from llmstack.data.document import Document
from llmstack.data.pipeline import run_pipeline
from llmstack.data.tokenizer import train_tokenizer
from llmstack.data.toxicity import toxicity_filter
from llmstack.errors import UserError

NEUTRAL = "the river mill valley market flour wheat town family house garden road bridge".split()
INSULTS = "zorgle blarghy snivvet grunkface".split()  # a made-up lexicon: the classifier learns it here


def sentence(rng, toxic):
    words = rng.choices(NEUTRAL, k=8)
    if toxic:
        words[rng.randrange(8)] = rng.choice(INSULTS)
    return " ".join(words)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A 1-layer BERT trained for 40 steps to tell the made-up insults from neutral text."""
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("toxicity")
    rng = random.Random(0)
    examples = [(sentence(rng, toxic), int(toxic)) for toxic in [False, True] * 32]
    tokenizer = train_tokenizer([t for t, _ in examples], 300, path, min_frequency=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other on a busy machine
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        id2label={0: "clean", 1: "toxic"},
        label2id={"clean": 0, "toxic": 1},
    )
    model = BertForSequenceClassification(config)
    batch = tokenizer([t for t, _ in examples], padding=True, return_tensors="pt")
    labels = torch.tensor([y for _, y in examples])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):  # loss 0.69 -> ~0.003 (seed 0)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.save_pretrained(path)
    return path


def test_classifier_drops_toxic_text_by_label_and_counts_it(classifier, tmp_path):
    rng = random.Random(1)  # held-out sentences
    texts = [sentence(rng, toxic) for toxic in [False, True] * 10]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
    )
    config = {
        "inputs": [{"paths": [str(tmp_path / "in.jsonl")]}],
        "output": str(tmp_path / "out"),
        "stages": [{"toxicity": {"scorer": "hf", "model_path": str(classifier), "thresholds": {"toxic": 0.5}}}],
    }
    stats = run_pipeline(config, show=lambda _: None)
    assert stats["toxicity"].drops == {"toxic_toxic": 10}
    kept = [json.loads(line) for line in (tmp_path / "out" / "clean" / "shard-00000.jsonl").read_text().splitlines()]
    assert [d["id"] for d in kept] == [str(i) for i in range(0, 20, 2)]
    assert all(d["meta"]["toxicity"]["toxic"] < 0.5 for d in kept)


def test_thresholds_are_per_label(classifier):
    doc = Document("the river zorgle mill valley market flour wheat")
    assert toxicity_filter("hf", model_path=str(classifier))(doc, Counter()) == "toxic_toxic"  # default 0.5
    assert toxicity_filter("hf", thresholds={"toxic": 1.01}, model_path=str(classifier))(doc, Counter()) is None
    assert toxicity_filter("hf", thresholds={"clean": 0.0}, model_path=str(classifier))(doc, Counter()) == "toxic_clean"
    with pytest.raises(UserError, match="labels"):
        toxicity_filter("hf", thresholds={"hate": 0.5}, model_path=str(classifier))
    with pytest.raises(UserError, match="not a model directory"):
        toxicity_filter("hf", model_path=str(Path(classifier) / "missing"))
    with pytest.raises(UserError, match="unknown toxicity scorer"):
        toxicity_filter("nope")


def test_english_wheel_model_flags_offensive_language():
    pytest.importorskip("profanity_check", reason="alt-profanity-check (the [data] extra) is not installed")
    stage = toxicity_filter()
    assert stage(Document("What a lovely morning walk along the river with the family."), Counter()) is None
    assert stage(Document("Shut up, you fucking idiot, you worthless piece of shit."), Counter()) == "toxic_offensive"


@pytest.fixture(scope="module")
def fasttext_classifier(tmp_path_factory):
    """A fastText classifier trained here on the made-up insults (dimension 8, one thread)."""
    fasttext = pytest.importorskip("fasttext", reason="fasttext-wheel (the [toxicity] extra) is not installed")
    path = tmp_path_factory.mktemp("fasttext")
    rng = random.Random(0)
    lines = [f"__label__{'toxic' if toxic else 'clean'} {sentence(rng, toxic)}\n" for toxic in [False, True] * 128]
    (path / "train.txt").write_text("".join(lines))
    # Held-out toxic sentences score >= 0.94 and clean ones <= 0.001 (training seeds 0-3).
    model = fasttext.train_supervised(
        str(path / "train.txt"), epoch=50, lr=0.5, dim=8, minCount=1, thread=1, seed=0, verbose=0
    )
    model.save_model(str(path / "model.bin"))
    return path / "model.bin"


def test_fasttext_classifier_drops_by_per_label_thresholds(fasttext_classifier):
    rng = random.Random(1)  # held-out sentences
    docs = [(Document(sentence(rng, toxic)), toxic) for toxic in [False, True] * 10]
    stage = toxicity_filter("fasttext", thresholds={"toxic": 0.5}, model_path=str(fasttext_classifier))
    assert [stage(doc, Counter()) for doc, _ in docs] == ["toxic_toxic" if toxic else None for _, toxic in docs]
    assert all(doc.meta["toxicity"]["toxic"] < 0.5 for doc, toxic in docs if not toxic)
    doc = Document("the river zorgle mill valley market flour wheat")
    lenient = toxicity_filter("fasttext", thresholds={"toxic": 1.01}, model_path=str(fasttext_classifier))
    assert lenient(doc, Counter()) is None
    on_clean = toxicity_filter("fasttext", thresholds={"clean": 0.0}, model_path=str(fasttext_classifier))
    assert on_clean(doc, Counter()) == "toxic_clean"
    with pytest.raises(UserError, match="cannot load"):
        toxicity_filter("fasttext", model_path=str(fasttext_classifier.parent / "train.txt"))
