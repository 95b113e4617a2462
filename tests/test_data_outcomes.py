"""The shipped pipeline configs' decisions are locked: every document of a varied corpus (Debian
Reference prose in six languages, boilerplate and repetition made from it, random-vocabulary texts
at and around the repetition thresholds, PII, width and mojibake samples) gets the same outcome as
when tests/data/pipeline_outcomes.json.gz was recorded: the stage and reason that dropped it, or the
text and metadata it was kept with, plus every stage's counts. A speed-up that changes a decision
fails here. After a deliberate change of behaviour, re-record and say why in the commit:

    python tests/test_data_outcomes.py   # rewrites tests/data/pipeline_outcomes.json.gz
"""

import functools
import gzip
import hashlib
import json
import random
import string
from collections import Counter
from pathlib import Path

import pytest

from llmstack.data.document import Document
from llmstack.data.pipeline import STAGES, load_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "debian_reference.jsonl.gz"
RECORD = Path(__file__).parent / "data" / "pipeline_outcomes.json.gz"
CONFIGS = ("data_pipeline.yaml", "data_zh.yaml", "data_multilingual.yaml")
# Every stage of the default config but language ID, each on every document by itself (languages
# guessed from the script): each statistic sees every text, not only what earlier stages kept.
EACH_STAGE_ALONE = "each stage of data_pipeline.yaml alone"


def _paragraphs():
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    by_language: dict[str, list[str]] = {}
    for row in rows:
        by_language.setdefault(row["language"], []).append(row["text"])
    return by_language


def _random_texts(rng):
    """Texts of random words from small vocabularies: n-grams repeat at every rate, ties included."""
    texts = []
    for vocabulary in (2, 3, 5, 8, 13, 30, 100, 1000):
        words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9))) for _ in range(vocabulary)]
        words += ["the", "and", "of", "#tag", "123", "...", "-", "•"]
        for _ in range(12):
            tokens = rng.choices(words, k=rng.randint(20, 400))
            lines, line = [], []
            for token in tokens:
                line.append(token)
                if rng.random() < 0.08:
                    lines.append(" ".join(line) + rng.choice([".", "!", "?", "", "", "…", ":"]))
                    line = []
            lines.append(" ".join(line) + ".")
            texts.append(rng.choice(["\n", "\n\n", " "]).join(lines))
    return texts


def _repeated(rng, paragraphs):
    """Prose with some of its lines, paragraphs or phrases repeated."""
    texts = []
    for _ in range(60):
        parts = rng.sample(paragraphs, rng.randint(2, 8))
        parts += rng.choices(parts, k=rng.randint(0, 4))
        rng.shuffle(parts)
        text = rng.choice(["\n", "\n\n"]).join(parts)
        if rng.random() < 0.5:
            start = rng.randrange(max(len(text) - 60, 1))
            phrase = text[start : start + rng.randint(10, 60)]
            text += (" " + phrase) * rng.randint(1, 15)
        texts.append(text)
    return texts


SAMPLES = [
    "Write to jane.doe@example.com or call +1 (555) 123-4567; the server is 8.8.8.8, not 10.0.0.1.",
    "联系电话：13812345678，身份证号码：11010519491231002X。请在工作日联系我们。",
    "ISBN 978-3-16-148410-0 was published 2021-03-04; version 1.2.3.4 is out. Call 030 1234 5678.",
    "ＡＢＣ１２３ is full width and ｶﾀｶﾅ is half width. The café is open. The end of the text.",
    "The cafÃ© is open and the naÃ¯ve guest pays with â‚¬5. It is good, and the house is big.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. The house is red. It is old.",
    "function f() { return 1; }\nThe function returns one. It is used in the code.",
    "Please enable JavaScript to view this page.\nThis site uses cookies. See our privacy policy.",
    "Zero\u200bwidth\u00a0spaces\u3000and\ttabs   \r\nand CRLF line ends.\n\n\n\nAnd blank lines.",
]


@functools.cache
def corpus():
    """(id, text) of every document, deterministic."""
    rng = random.Random(16)
    by_language = _paragraphs()
    texts = []
    for language, found in sorted(by_language.items()):
        for size in (1, 3, 5):
            texts += [(f"{language}-{size}p-{i}", "\n\n".join(found[i : i + size])) for i in range(0, len(found), size)]
        menu = ["\n".join(p[:8].strip() for p in found[i : i + 40]) for i in range(0, len(found), 40)]
        texts += [(f"{language}-menu-{i}", t) for i, t in enumerate(menu)]
        texts += [(f"{language}-repeated-{i}", t) for i, t in enumerate(_repeated(rng, found))]
        texts += [(f"{language}-lines-{i}", "\n".join(found[i : i + 4])) for i in range(0, len(found), 16)]
    texts += [(f"random-{i}", t) for i, t in enumerate(_random_texts(rng))]
    texts += [(f"sample-{i}", t) for i, t in enumerate(SAMPLES)]
    return texts


def _chains(config):
    """The config's stages as chains: one chain of all of them, or one chain per stage."""
    name = CONFIGS[0] if config == EACH_STAGE_ALONE else config
    specs = load_config(ROOT / "configs" / name)["stages"]
    stages = [(stage, STAGES[stage](**params)) for stage, params in specs]
    if config == EACH_STAGE_ALONE:
        return [[stage] for stage in stages if stage[0] != "language"]
    return [stages]


def _outcome(doc, chain, counts):
    """ "stage:reason" of the stage that dropped the document, or "kept:<hash of text and metadata>"."""
    for name, stage in chain:
        reason = stage(doc, counts[name])
        if reason is not None:
            return f"{name}:{reason}"
    kept = json.dumps([doc.text, doc.meta], ensure_ascii=False, sort_keys=True).encode()
    return "kept:" + hashlib.blake2b(kept, digest_size=6).hexdigest()


def outcomes(config):
    """{id: outcome (one per chain, joined by " | ")} and {stage: counts}."""
    chains, found = _chains(config), {}
    counts = {name: Counter() for chain in chains for name, _ in chain}
    for doc_id, text in corpus():
        found[doc_id] = " | ".join(_outcome(Document(text, id=doc_id), chain, counts) for chain in chains)
    return found, {name: dict(sorted(c.items())) for name, c in counts.items() if c}


def record():
    recorded = {}
    for config in (*CONFIGS, EACH_STAGE_ALONE):
        documents, counts = outcomes(config)
        recorded[config] = {"documents": documents, "counts": counts}
    with gzip.open(RECORD, "wt", encoding="utf-8") as f:
        json.dump(recorded, f, indent=0, ensure_ascii=False)


@pytest.mark.parametrize("config", [*CONFIGS, EACH_STAGE_ALONE])
def test_every_document_keeps_its_recorded_outcome(config):
    with gzip.open(RECORD, "rt", encoding="utf-8") as f:
        expected = json.load(f)[config]
    documents, counts = outcomes(config)
    changed = {i: (expected["documents"].get(i), o) for i, o in documents.items() if expected["documents"].get(i) != o}
    assert not changed, f"{len(changed)} documents changed outcome, e.g. {list(changed.items())[:5]}"
    assert documents.keys() == expected["documents"].keys()
    assert counts == expected["counts"]


if __name__ == "__main__":
    record()
