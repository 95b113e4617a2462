"""The cleaning pipeline's speed per worker process, stage by stage and whole, on text every
Debian/Python machine has: the Python standard library's docstrings (about 1.3 MB of English
prose) and the licence texts under /usr/share/common-licenses, as JSONL documents.

The job runs with one worker through `run_pipeline`, so the figures are the pipeline's own
accounting (report.json): each stage's input bytes over its summed seconds, and the whole as the
input bytes over the seconds of every phase (read, stages, dedup keys, dedup decision, writing).
Target (issue 16): >= 2 MB/s per worker for the default pipeline, configs/data_pipeline.yaml's
stages and dedup. The best of `--repeats` runs is printed (the least disturbed by other load),
with the language detector's alternatives side by side when asked.

    python bench/bench_pipeline.py [--repeats 3] [--copies 2] [--detectors cld2 lingua] [--outcomes FILE]

`--outcomes FILE` checks that a change of the code kept the pipeline's decisions: the first time it
writes each detector's kept documents (id and a hash of the text) and the drops by stage and reason
to FILE; when FILE exists it compares them with what FILE holds and exits 1 on any difference.
"""

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import yaml

from llmstack.data.pipeline import run_pipeline
from llmstack.data.stdlib_corpus import stdlib_docstrings

ROOT = Path(__file__).resolve().parent.parent
LICENCES = Path("/usr/share/common-licenses")


def corpus(path, copies):
    """Docstrings and licence paragraphs (blocks of at least 200 characters), `copies` times, the
    copies numbered so that only the first is an exact duplicate of nothing: the dedup stages see a
    realistic share of duplicates (1 - 1/copies)."""
    texts = stdlib_docstrings()
    if LICENCES.is_dir():
        for licence in sorted(p for p in LICENCES.iterdir() if p.is_file()):
            blocks = licence.read_text(errors="replace").split("\n\n")
            texts += ["\n\n".join(blocks[i : i + 8]) for i in range(0, len(blocks), 8)]
    texts = [t for t in texts if len(t) >= 200]
    with open(path, "w", encoding="utf-8") as f:
        for copy in range(copies):
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": f"{copy}-{i}", "text": text}) + "\n")
    return path.stat().st_size


def default_config(detector):
    config = yaml.safe_load((ROOT / "configs" / "data_pipeline.yaml").read_text())
    stages = []
    for entry in config["stages"]:
        ((name, params),) = entry.items() if isinstance(entry, dict) else [(entry, {})]
        if name == "language":
            params = {**params, "detector": detector}
        stages.append({name: params})
    return {"stages": stages, "dedup": config["dedup"], "workers": 1}


def run_once(data, detector, work):
    config = {**default_config(detector), "inputs": [{"paths": [str(data)]}], "output": str(work)}
    stats = run_pipeline(config, show=lambda _: None)
    seconds = {name: s.seconds for name, s in stats.items()}
    return stats, sum(seconds.values())


def outcomes(stats, work):
    """What a run decided: {kept: {id: hash of the text}, drops: {stage: {reason: count}}}."""
    kept = {}
    for path in sorted((work / "clean").glob("shard-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            doc = json.loads(line)
            kept[doc["id"]] = hashlib.blake2b(doc["text"].encode(), digest_size=8).hexdigest()
    return {"kept": kept, "drops": {name: dict(sorted(s.drops.items())) for name, s in stats.items() if s.drops}}


def check_outcomes(path, found):
    """Record `found` ({detector: outcomes}) in `path`, or compare it with the record there."""
    if not path.exists():
        path.write_text(json.dumps(found, sort_keys=True))
        print(f"\noutcomes recorded in {path}")
        return True
    recorded, same = json.loads(path.read_text()), True
    for detector, outcome in found.items():
        if detector not in recorded:
            continue
        before = recorded[detector]
        changed = sorted(set(before["kept"].items()) ^ set(outcome["kept"].items()))
        if changed or before["drops"] != outcome["drops"]:
            same = False
            print(f"\n{detector}: outcomes differ from {path}: {len(changed)} kept documents, e.g. {changed[:5]};")
            print(f"  drops before {before['drops']}\n  drops now    {outcome['drops']}")
        else:
            print(f"\n{detector}: the same {len(outcome['kept'])} documents kept, the same drops as in {path}")
    return same


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=2, help="copies of the corpus (duplicates for dedup)")
    parser.add_argument("--detectors", nargs="+", default=["cld2"], help="language detectors to compare")
    parser.add_argument("--outcomes", type=Path, help="record the decisions here, or compare with the record")
    args = parser.parse_args()
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "corpus.jsonl"
        size = corpus(data, args.copies)
        print(
            f"corpus: {size / 1e6:.2f} MB of JSONL (stdlib docstrings + common-licenses, {args.copies} copies)",
            file=sys.stderr,
        )
        for detector in args.detectors:
            runs = [run_once(data, detector, Path(tmp) / f"{detector}-{r}") for r in range(args.repeats)]
            stats, total = min(runs, key=lambda run: run[1])
            found[detector] = outcomes(stats, Path(tmp) / f"{detector}-0")
            print(f"\ndefault pipeline, language detector {detector}: best of {args.repeats} runs, one worker")
            print(f"{'stage':<20}{'MB in':>8}{'seconds':>9}{'MB/s':>9}")
            for name, s in stats.items():
                speed = f"{s.bytes_in / 1e6 / s.seconds:9.2f}" if s.seconds and s.bytes_in else f"{'-':>9}"
                print(f"{name:<20}{s.bytes_in / 1e6:8.2f}{s.seconds:9.3f}{speed}")
            print(
                f"{'whole pipeline':<20}{size / 1e6:8.2f}{total:9.3f}{size / 1e6 / total:9.2f}"
                f"   (all runs: {', '.join(f'{size / 1e6 / t:.2f}' for _, t in runs)} MB/s)"
            )
    if args.outcomes and not check_outcomes(args.outcomes, found):
        sys.exit(1)


if __name__ == "__main__":
    main()
