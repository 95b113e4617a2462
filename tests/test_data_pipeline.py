"""The cleaning pipeline end to end: bad input counted, shards, dedup, report, kill and resume."""

import json
import os
import random
import signal
import string
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmstack.data.pipeline import cleaned_files, load_config, run_pipeline
from llmstack.data.reader import Shard, plan_shards, read_shard
from llmstack.data.report import StageStats
from llmstack.errors import UserError

SENTENCE = "The {0} and the {1} sold the flour to a {2} near the {3} of {4}."


def prose(i, sentences=8):
    """Document i: English-like sentences whose every 5 consecutive words hold a noun of its own, so
    different documents share no MinHash shingle (LSH cannot pair them by chance)."""
    rng = random.Random(i)
    nouns = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 8))) for _ in range(5 * sentences)]
    return " ".join(SENTENCE.format(*nouns[5 * k : 5 * k + 5]) for k in range(sentences))


def write_jsonl(path, records):
    with open(path, "wb") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())


def read_clean(output):
    return [json.loads(line) for path in cleaned_files(output) for line in Path(path).read_text().splitlines()]


def test_bad_input_is_skipped_and_counted_by_reason(tmp_path):
    write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"text": prose(0), "id": "good-0", "url": "https://a.example/0"},
            b'{"text": "broken json\n',
            b'{"text": "invalid \xff utf-8"}\n',
            {"body": "no text field"},
            {"text": 42},
            ["not", "an", "object"],
            {"text": "   \n "},
            {"text": "x" * 3000},
            b"\n",
            {"text": prose(1)},
        ],
    )
    (tmp_path / "b.txt").write_text(prose(2))
    (tmp_path / "c.txt").write_bytes(b"bad \xfe bytes")
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"text": [prose(3), None], "id": ["pq-0", "pq-1"]}), tmp_path / "e.parquet")
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "f.jsonl")  # listed by the glob, unreadable
    config = {
        "inputs": [
            {
                "paths": [str(tmp_path / "*.jsonl"), str(tmp_path / "*.txt"), str(tmp_path / "*.parquet")],
                "source": "test",
            }
        ],
        "output": str(tmp_path / "out"),
        "max_doc_bytes": 2048,
    }
    stats = run_pipeline(config, show=lambda _: None)
    read = stats["read"]
    assert read.drops == {
        "malformed_json": 1,
        "invalid_utf8": 2,
        "missing_text": 3,
        "malformed_record": 1,
        "empty": 1,
        "too_large": 1,
        "unreadable_file": 2,
    }
    assert (read.docs_in, read.docs_out) == (15, 4) and read.docs_in == read.docs_out + sum(read.drops.values())
    docs = read_clean(tmp_path / "out")
    assert sorted(d["text"] for d in docs) == sorted(prose(i) for i in range(4))
    by_text = {d["text"]: d for d in docs}
    assert by_text[prose(0)]["id"] == "good-0" and by_text[prose(0)]["meta"] == {"url": "https://a.example/0"}
    offset = (tmp_path / "a.jsonl").read_bytes().rindex(b'{"text": "The')  # the default id: file and byte offset
    assert by_text[prose(1)]["id"] == f"{tmp_path / 'a.jsonl'}:{offset}"
    assert by_text[prose(3)]["id"] == "pq-0" and {d["source"] for d in docs} == {"test"}


def test_jsonl_shards_read_every_line_once(tmp_path):
    lines = [{"text": f"document {i} " + "word " * (i % 7)} for i in range(200)]
    write_jsonl(tmp_path / "a.jsonl", lines)
    shards = plan_shards([{"paths": [str(tmp_path / "a.jsonl")]}], shard_bytes=97)
    assert len(shards) > 20
    texts = [doc.text for shard in shards for doc in read_shard(shard, StageStats())]
    assert texts == [line["text"] for line in lines]


def corpus(tmp_path, shards=3):
    """Shards of prose with an exact duplicate (case/spacing), a near duplicate, junk and PII."""
    near = prose(1).replace("sold the flour", "sold their flour", 1)
    docs = [
        [prose(0), prose(1), "menu\nhome\nabout\nlogin", prose(2) + " Mail me at jo@example.com."],
        [prose(0).upper().replace(" ", "  "), near, prose(3), "KILLME " + prose(4)],
        [prose(5), prose(6) + " Call +1 (555) 123-4567.", "tiny"],
    ]
    for s in range(shards):
        write_jsonl(tmp_path / f"in-{s}.jsonl", [{"text": t} for t in docs[s]])
    return [str(tmp_path / "in-*.jsonl")]


def pipeline_config(paths, output, **extra):
    return {
        "inputs": [{"paths": paths}],
        "output": str(output),
        "stages": ["normalize", {"gopher_quality": {"min_words": 20}}, "fineweb", "pii"],
        "dedup": {"exact": True, "near": {}, "max_in_memory": 8},
        **extra,
    }


def test_pipeline_filters_dedups_masks_and_reports(tmp_path, capsys):
    paths = corpus(tmp_path)
    stats = run_pipeline(pipeline_config(paths, tmp_path / "out", workers=2))
    texts = [d["text"] for d in read_clean(tmp_path / "out")]
    assert texts == [
        prose(0),
        prose(1),
        prose(2) + " Mail me at <EMAIL>.",
        prose(3),
        "KILLME " + prose(4),
        prose(5),
        prose(6) + " Call <PHONE>.",
    ]
    assert stats["dedup"].drops == {"exact_duplicate": 1, "near_duplicate": 1}
    assert stats["gopher_quality"].drops == {"gopher_too_few_words": 2}
    assert stats["pii"].counts == {"emails": 1, "phone_numbers": 1}
    assert list(stats) == ["read", "normalize", "gopher_quality", "fineweb", "pii", "dedup"]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["stages"]["dedup"]["docs_out"] == 7 and saved["stages"]["read"]["docs_in"] == 11
    assert (tmp_path / "out" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "near_duplicate 1" in capsys.readouterr().out


def kill_on(marker):
    """A stage that SIGKILLs its own process on a marked document when LLMSTACK_TEST_KILL is set."""

    def stage(doc, counts):
        if marker in doc.text and os.environ.get("LLMSTACK_TEST_KILL"):
            os.kill(os.getpid(), signal.SIGKILL)
        return None

    return stage


def test_killed_job_resumes_from_finished_shards_without_half_written_files(tmp_path):
    paths = corpus(tmp_path)
    reference = tmp_path / "reference"
    run_pipeline(pipeline_config(paths, reference), show=lambda _: None)

    config = pipeline_config(paths, tmp_path / "out")
    config["stages"].append({"test_data_pipeline:kill_on": {"marker": "KILLME"}})
    script = (
        "import sys, json; sys.path.insert(0, sys.argv[1]);"
        "from llmstack.data.pipeline import run_pipeline; run_pipeline(json.loads(sys.argv[2]))"
    )
    killed = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), json.dumps(config)],
        env={**os.environ, "LLMSTACK_TEST_KILL": "1"},
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL
    filtered = tmp_path / "out" / "filtered"
    assert sorted(p.name for p in filtered.glob("shard-*.jsonl")) == ["shard-00000.jsonl"]
    assert [p.name.split(".tmp-")[0] for p in filtered.glob("*.tmp-*")] == ["shard-00001.jsonl"]
    done = (filtered / "shard-00000.stats.json").stat().st_mtime_ns

    run_pipeline(config, show=lambda _: None)  # the same config, no kill this time
    assert (filtered / "shard-00000.stats.json").stat().st_mtime_ns == done  # not redone
    assert not list((tmp_path / "out").rglob("*.tmp-*"))
    assert read_clean(tmp_path / "out") == read_clean(reference)


def test_config_errors_are_user_errors(tmp_path):
    paths = corpus(tmp_path, shards=1)
    with pytest.raises(UserError, match="unknown stage 'nope'"):
        run_pipeline(pipeline_config(paths, tmp_path / "a", stages=["nope"]))
    with pytest.raises(UserError, match="stage gopher_quality: .*unexpected keyword"):
        run_pipeline(pipeline_config(paths, tmp_path / "b", stages=[{"gopher_quality": {"min_wrds": 3}}]))
    with pytest.raises(UserError, match="unknown pipeline config keys"):
        load_config({"inputs": [{"paths": paths}], "output": "x", "stagse": []})
    with pytest.raises(UserError, match="no data file matches"):
        run_pipeline(pipeline_config([str(tmp_path / "missing-*.jsonl")], tmp_path / "c"))
    run_pipeline(pipeline_config(paths, tmp_path / "d"), show=lambda _: None)
    with pytest.raises(UserError, match="another config"):
        run_pipeline(pipeline_config(paths, tmp_path / "d", stages=[]))


def test_cli_clean_runs_a_yaml_config(tmp_path):
    from llmstack.cli.main import main

    paths = corpus(tmp_path, shards=1)
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(pipeline_config(paths, tmp_path / "ignored")))  # JSON is YAML
    assert main(["data", "clean", "--config", str(config), "--output", str(tmp_path / "out")]) == 0
    assert [d["text"] for d in read_clean(tmp_path / "out")][:2] == [prose(0), prose(1)]
    assert main(["data", "clean", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_shard_round_trips_through_the_plan():
    shard = Shard("a.jsonl", "jsonl", "web", start=5, end=9)
    assert Shard(**shard.to_dict()) == shard
