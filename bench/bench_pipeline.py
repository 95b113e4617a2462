"""The cleaning pipeline's speed per worker process, stage by stage and whole, on text every
Debian/Python machine has: the Python standard library's docstrings (about 1.3 MB of English
prose) and the licence texts under /usr/share/common-licenses, as JSONL documents.

The job runs with one worker through `run_pipeline`, so the figures are the pipeline's own
accounting (report.json): each stage's input bytes over its summed seconds, and the whole as the
input bytes over the seconds of every phase (read, stages, dedup keys, dedup decision, writing).
Target (issue 16): >= 2 MB/s per worker for the default pipeline, configs/data_pipeline.yaml's
stages and dedup. The best of `--repeats` runs is printed (the least disturbed by other load),
with the language detector's alternatives side by side when asked.

    python bench/bench_pipeline.py [--repeats 3] [--copies 2] [--detectors cld2 lingua]
"""

import argparse
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=2, help="copies of the corpus (duplicates for dedup)")
    parser.add_argument("--detectors", nargs="+", default=["cld2"], help="language detectors to compare")
    args = parser.parse_args()
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
            print(f"\ndefault pipeline, language detector {detector}: best of {args.repeats} runs, one worker")
            print(f"{'stage':<20}{'MB in':>8}{'seconds':>9}{'MB/s':>9}")
            for name, s in stats.items():
                speed = f"{s.bytes_in / 1e6 / s.seconds:9.2f}" if s.seconds and s.bytes_in else f"{'-':>9}"
                print(f"{name:<20}{s.bytes_in / 1e6:8.2f}{s.seconds:9.3f}{speed}")
            print(
                f"{'whole pipeline':<20}{size / 1e6:8.2f}{total:9.3f}{size / 1e6 / total:9.2f}"
                f"   (all runs: {', '.join(f'{size / 1e6 / t:.2f}' for _, t in runs)} MB/s)"
            )


if __name__ == "__main__":
    main()
