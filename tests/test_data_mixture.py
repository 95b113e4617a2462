"""Mixture balance: each source's share of tokens against its target, in `data pack` and the
training stream; more than 20% off a target is a warning naming the source (seed 002's rule)."""

import json
import logging

import pytest

from llmstack.cli.main import main
from llmstack.data.mixture import token_shares, unbalanced
from llmstack.data.stream import MixtureStream
from llmstack.data.tokenizer import train_tokenizer


def test_a_source_more_than_20_percent_off_its_target_is_named(caplog):
    shares = token_shares({"web": 63, "code": 37}, {"web": 0.7, "code": 0.3})
    assert [round(s.deviation, 3) for s in shares] == [-0.1, 0.233]
    with caplog.at_level(logging.WARNING):
        assert [s.source for s in unbalanced(shares)] == ["code"]
    assert "mixture source code has 37.0% of the tokens against a target of 30.0%" in caplog.text
    assert unbalanced(token_shares({"web": 65, "code": 35}, {"web": 0.7, "code": 0.3})) == []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """web: 2 files of short documents; books: 2 files of documents 8x as long."""
    root = tmp_path_factory.mktemp("mixture")
    for source, words in (("web", 4), ("books", 32)):
        for f in range(2):
            with open(root / f"{source}-{f}.jsonl", "w") as out:
                for d in range(50):
                    out.write(json.dumps({"text": " ".join(["lorem", source, str(d)] * words)}) + "\n")
    return root, train_tokenizer((f"lorem web books {i}" for i in range(100)), 300, root / "tokenizer")


def test_pack_reports_token_shares_against_the_weights(corpus, capsys, caplog):
    root, _ = corpus
    args = [
        "data",
        "pack",
        "--data",
        str(root / "web-*.jsonl"),
        str(root / "books-*.jsonl"),
        "--tokenizer",
        str(root / "tokenizer"),
        "--out",
        str(root / "packed" / "p"),
        "--weights",
        "0.5",
        "0.5",
    ]
    with caplog.at_level(logging.WARNING):
        assert main(args) == 0
    table = capsys.readouterr().err
    assert "web-*.jsonl" in table and "books-*.jsonl" in table
    assert {r.args[0] for r in caplog.records} == {str(root / "web-*.jsonl"), str(root / "books-*.jsonl")}
    assert main([*args[:-2], "0.5"]) == 2  # one weight for two sources


def test_stream_counts_tokens_by_source(corpus, caplog):
    """Documents are mixed by count, so long books take far more than their weight in tokens."""
    root, tokenizer = corpus
    stream = MixtureStream(
        [
            {"paths": str(root / "web-*.jsonl"), "weight": 0.5, "name": "web"},
            {"paths": str(root / "books-*.jsonl"), "weight": 0.5, "name": "books"},
        ],
        tokenizer,
        seq_len=32,
    )
    batches = stream.micro_batches(0, 4, 0, 1)
    for _ in range(20):
        next(batches)
    shares = {s.source: s for s in stream.token_shares()}
    assert sum(stream.source_tokens.values()) == 20 * 4 * 32
    assert shares["books"].share > 0.75 and shares["books"].target == 0.5
    with caplog.at_level(logging.WARNING):
        assert {s.source for s in unbalanced(stream.token_shares())} == {"web", "books"}
