"""The cleaning pipeline: raw documents to filtered, deduplicated JSONL shards, from one config.

    inputs -> read -> stage 1 -> ... -> stage n -> dedup -> OUTPUT/clean/shard-NNNNN.jsonl

Stages are plain functions over documents (see `document.Stage`), named and configured in order
in the config's `stages` list. The job runs in three phases over shards of the input:
1. filter (worker processes, one shard each): read, run the stages, write the kept documents to
   `filtered/` and their dedup keys (exact hash, MinHash LSH bands, paragraph hashes) beside them;
2. dedup (main process): sort-merge the keys of all shards, cluster, decide what to drop;
3. write (worker processes): copy each shard to `clean/` without what dedup dropped.
Without a `dedup` section phase 1 writes to `clean/` directly.

A stage's `seconds` are CPU seconds of the process that ran it (summed over workers), so its
MB/s is the speed of one worker however busy the machine is; the report's wall time is the job's.

Every file appears under its final name only when complete (temporary name, then rename), and a
shard's statistics file is written last, as the mark that the shard is done. A job that is killed
and run again with the same config skips what is done and deletes the half-written files.
"""

import functools
import importlib
import inspect
import json
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml
from tqdm import tqdm

from llmstack.errors import UserError

from . import report
from .atomic import atomic_path, remove_temporaries
from .augment import Augmenter
from .blocklist import url_blocklist, word_blocklist
from .decontaminate import decontaminate
from .dedup import (
    EXACT_DUPLICATE,
    NEAR_DUPLICATE,
    PARAGRAPH_BITS,
    cluster_status,
    duplicate_pairs,
    duplicate_paragraphs,
    key_range,
    split_paragraphs,
    write_shard_keys,
)
from .document import Document, Stage, utf8_size
from .langid import language_filter
from .minhash import MinHasher
from .normalize import normalize
from .perplexity import perplexity_filter
from .pii import pii
from .quality import c4_lines, fineweb, gopher_quality, gopher_repetition, language_aware
from .reader import Shard, plan_shards, read_shard
from .report import StageStats
from .toxicity import toxicity_filter


def _bind(stage: Callable[..., str | None]) -> Callable[..., Stage]:
    """The factory of a stage that loads nothing: the function with its parameters bound."""

    def factory(**params: Any) -> Stage:
        inspect.signature(stage).bind(None, None, **params)  # a misspelt parameter fails now, not mid-job
        return functools.partial(stage, **params)

    return factory


# name in the config -> factory(**params) -> stage. A name "package.module:factory" loads a user's own.
STAGES: dict[str, Callable[..., Stage]] = {
    "normalize": _bind(normalize),
    "language": language_filter,
    "gopher_quality": language_aware(gopher_quality),
    "gopher_repetition": language_aware(gopher_repetition),
    "c4_lines": language_aware(c4_lines),
    "fineweb": language_aware(fineweb),
    "perplexity": perplexity_filter,
    "pii": _bind(pii),
    "toxicity": toxicity_filter,
    "word_blocklist": word_blocklist,
    "url_blocklist": url_blocklist,
    "decontaminate": decontaminate,
}
CONFIG_KEYS = {"inputs", "output", "stages", "dedup", "augment", "workers", "shard_bytes", "max_doc_bytes"}
DEDUP_KEYS = {"exact", "near", "paragraphs", "max_in_memory"}
DROP_REASONS = {EXACT_DUPLICATE: "exact_duplicate", NEAR_DUPLICATE: "near_duplicate"}


def load_config(config: dict[str, Any] | str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A validated config dict from a YAML path or a dict (see configs/data_pipeline.yaml), with
    the top-level keys in `overrides` replaced."""
    if not isinstance(config, dict):
        try:
            config = yaml.safe_load(Path(config).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"cannot read the pipeline config {config}: {e}") from None
    if not isinstance(config, dict):
        raise UserError("the pipeline config must be a mapping of settings")
    # plain JSON, as saved for reruns (dict() tells the type checker what json.loads gives here)
    config = dict(json.loads(json.dumps({**config, **(overrides or {})}, default=str)))
    if not config.get("inputs") or not config.get("output"):
        raise UserError("the pipeline config needs `inputs` (a list of {paths: [...]}) and `output` (a directory)")
    if unknown := set(config) - CONFIG_KEYS:
        raise UserError(f"unknown pipeline config keys {sorted(unknown)}; expected some of {sorted(CONFIG_KEYS)}")
    config = {
        "workers": 1,
        "shard_bytes": 64 * 2**20,
        "max_doc_bytes": 10 * 2**20,
        "dedup": None,
        "augment": None,
        **config,
        "stages": [_stage_spec(entry) for entry in config.get("stages") or []],
    }
    _check_language_settings(config["stages"])
    if config["dedup"] is not None:
        dedup = {"exact": True, "near": None, "paragraphs": None, "max_in_memory": 50_000_000, **config["dedup"]}
        if unknown := set(dedup) - DEDUP_KEYS:
            raise UserError(f"unknown dedup keys {sorted(unknown)}; expected some of {sorted(DEDUP_KEYS)}")
        for key in ("near", "paragraphs"):
            dedup[key] = _section(key, dedup[key])
        config["dedup"] = dedup
    return config


def _section(name: str, value: Any) -> dict[str, Any] | None:
    """A dedup method's settings: a mapping, true for the defaults, false or null for off."""
    if value is True:
        return {}
    if value is False or value is None:
        return None
    if isinstance(value, dict):
        return value
    raise UserError(f"dedup.{name} must be a mapping of settings, true or false; got {value!r}")


def _check_language_settings(stages: Sequence[list[Any]]) -> None:
    """Refuse per-language settings that name an unknown language or parameter, or a language the
    language stage drops (so that no document would use them), before any work starts."""
    kept = [params.get("languages", ["en"]) for name, params in stages if name == "language"]
    listed = None if not kept or not all(kept) else {str(code) for codes in kept for code in codes}
    for name, params in stages:
        if name == "language" and listed:
            if dead := sorted(set(params.get("thresholds") or {}) - listed):
                raise UserError(f"stage language: thresholds for {dead}, which its `languages` {sorted(listed)} drop")
        check = getattr(STAGES.get(name), "check_languages", None)
        if check is not None:
            check(params.get("languages"), listed)


def _stage_spec(entry: Any) -> list[Any]:
    """`name` or `{name: {params}}` -> [name, params]."""
    if isinstance(entry, str):
        return [entry, {}]
    if isinstance(entry, dict) and len(entry) == 1:
        ((name, params),) = entry.items()
        return [name, params or {}]
    raise UserError(f"a stage is a name or {{name: {{parameters}}}}; got {entry!r}")


def _factory(name: str) -> Callable[..., Stage]:
    if name in STAGES:
        return STAGES[name]
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        raise UserError(f"unknown stage {name!r}: use one of {sorted(STAGES)} or 'package.module:factory'") from None


@functools.lru_cache(maxsize=1)
def _build_stages(specs_json: str) -> list[tuple[str, Stage]]:
    """[(unique name, stage)], built once per process (detectors and models load here)."""
    stages: list[tuple[str, Stage]] = []
    seen: dict[str, int] = {}
    for name, params in json.loads(specs_json):
        try:
            stage = _factory(name)(**params)
        except TypeError as e:
            raise UserError(f"stage {name}: {e}") from None
        seen[name] = seen.get(name, 0) + 1
        stages.append((name if seen[name] == 1 else f"{name}#{seen[name]}", stage))
    return stages


@functools.lru_cache(maxsize=1)
def _augmenter(augment_json: str) -> Augmenter | None:
    """The config's `augment` section built once per process (translation models load here)."""
    options = json.loads(augment_json)
    if options is None:
        return None
    try:
        return Augmenter(**options)
    except TypeError as e:
        raise UserError(f"augment: {e}") from None


def _hasher(dedup: dict[str, Any] | None) -> MinHasher | None:
    return MinHasher(**dedup["near"]) if dedup and dedup["near"] is not None else None


def cleaned_files(output: str | Path) -> list[str]:
    """The finished shards of a job whose config had `output`."""
    return sorted(str(p) for p in Layout(output).clean.glob("shard-*.jsonl"))


class Layout:
    """Where a job keeps its files."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.filtered, self.keys, self.clean = self.root / "filtered", self.root / "dedup", self.root / "clean"

    def shard(self, directory: Path, i: int, suffix: str = ".jsonl") -> Path:
        return directory / f"shard-{i:05d}{suffix}"


def _write_json(path: Path, value: Any) -> None:
    with atomic_path(path) as temp:
        temp.write_text(json.dumps(value, indent=1))


def _read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def _run_stages(doc: Document, stages: Sequence[tuple[str, Stage]], stats: dict[str, StageStats]) -> bool:
    """Run `doc` through the stages; True if every stage kept it."""
    text, size = doc.text, utf8_size(doc.text)
    start = time.process_time()  # one clock reading a stage: each ends where the next starts
    for name, stage in stages:
        s = stats[name]
        s.docs_in += 1
        s.bytes_in += size
        reason = stage(doc, s.counts)
        now = time.process_time()
        s.seconds += now - start
        start = now
        if reason is not None:
            s.drops[reason] += 1
            return False
        if doc.text is not text:  # the stage rewrote it
            text, size = doc.text, utf8_size(doc.text)
        s.docs_out += 1
        s.bytes_out += size
    return True


def _augment(augmenter: Augmenter, doc: Document, stats: dict[str, StageStats]) -> list[Document]:
    """The augmented copies of a kept document, timed and counted under the `augment` stage."""
    s = stats["augment"]
    start = time.process_time()
    copies = augmenter.copies(doc, s.counts)
    s.seconds += time.process_time() - start
    s.docs_in += 1
    s.bytes_in += utf8_size(doc.text)
    s.docs_out += len(copies)
    s.bytes_out += sum(utf8_size(c.text) for c in copies)
    return copies


def filter_shard(config: dict[str, Any], i: int, shard: dict[str, Any]) -> None:
    """Phase 1 for shard i: read, run the stages, write the kept documents and their dedup keys."""
    layout, dedup = Layout(config["output"]), config["dedup"]
    for directory in (layout.filtered, layout.keys, layout.clean):
        remove_temporaries(directory, f"shard-{i:05d}")
    stages = _build_stages(json.dumps(config["stages"]))
    augmenter = _augmenter(json.dumps(config["augment"]))
    stats = {"read": StageStats(), **{name: StageStats() for name, _ in stages}}
    if augmenter:
        stats["augment"] = StageStats()
    out_dir = layout.filtered if dedup else layout.clean
    kept, original = [], []
    start = time.process_time()
    with atomic_path(layout.shard(out_dir, i)) as temp, open(temp, "w", encoding="utf-8") as out:
        for doc in read_shard(Shard(**shard), stats["read"], config["max_doc_bytes"]):
            if not _run_stages(doc, stages, stats):
                continue
            copies = _augment(augmenter, doc, stats) if augmenter else []
            for written in [doc, *copies]:
                out.write(written.to_json() + "\n")
                kept.append(written.text)
                original.append(written is doc)
    stats["read"].seconds = time.process_time() - start - sum(s.seconds for s in stats.values())
    if dedup:
        start = time.process_time()
        paragraphs = dedup["paragraphs"]
        write_shard_keys(
            layout.shard(layout.keys, i, ""),
            kept,
            dedup["exact"],
            _hasher(dedup),
            paragraphs.get("min_chars", 32) if paragraphs is not None else None,
            include=original,
        )
        stats["dedup"] = StageStats(seconds=time.process_time() - start)
    _write_json(
        layout.shard(out_dir, i, ".stats.json"),
        {"documents": len(kept), "stages": {n: s.to_dict() for n, s in stats.items()}},
    )


def _key_tables(layout: Layout, counts: Sequence[int]) -> Callable[..., list[tuple[str, int]]]:
    """tables(kind): every shard's key table of `kind` with the global number of its first document."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)

    def tables(kind: str, shift: int = 0) -> list[tuple[str, int]]:
        return [(str(layout.shard(layout.keys, i, f".{kind}")), int(offsets[i]) << shift) for i in range(len(counts))]

    return tables


def _pairs_file(layout: Layout, part: int, parts: int) -> Path:
    return layout.keys / f"pairs-{part:05d}-of-{parts:05d}.npz"


def merge_range(config: dict[str, Any], counts: Sequence[int], part: int, parts: int) -> None:
    """Phase 2a for one of `parts` slices of the key space: the pairs of documents sharing an exact
    or LSH key in it, and the repeated paragraphs whose hash is in it, saved under dedup/."""
    start = time.process_time()
    layout, dedup = Layout(config["output"]), config["dedup"]
    remove_temporaries(layout.keys, f"pairs-{part:05d}-")
    tables, hasher, lo_hi = _key_tables(layout, counts), _hasher(dedup), key_range(part, parts)
    exact = duplicate_pairs(tables("exact"), 1, dedup["max_in_memory"], *lo_hi) if dedup["exact"] else None
    near = duplicate_pairs(tables("lsh"), hasher.bands, dedup["max_in_memory"], *lo_hi) if hasher else None
    paragraphs = (
        duplicate_paragraphs(tables("paragraphs", PARAGRAPH_BITS), dedup["max_in_memory"], *lo_hi)
        if dedup["paragraphs"] is not None
        else np.empty(0, dtype=np.uint64)
    )
    no_pairs = np.empty((2, 0), dtype=np.int64)
    with atomic_path(_pairs_file(layout, part, parts)) as temp, open(temp, "wb") as f:
        np.savez(
            f,
            exact=no_pairs if exact is None else np.stack(exact),
            near=no_pairs if near is None else np.stack(near),
            paragraphs=paragraphs,
            seconds=time.process_time() - start,
        )


def cluster(config: dict[str, Any], counts: Sequence[int], parts: int) -> None:
    """Phase 2b: the status of every document and the paragraphs to remove, from the pairs of all
    key ranges, saved under dedup/ (status.npy last: the mark that this phase is done)."""
    start = time.process_time()
    layout, dedup = Layout(config["output"]), config["dedup"]
    files = [_pairs_file(layout, part, parts) for part in range(parts)]
    if missing := [f.name for f in files if not f.exists()]:
        raise UserError(f"dedup: the merge phase has not finished key ranges {missing}; run those tasks first")
    found = [np.load(f) for f in files]
    remove_temporaries(layout.keys, "status")
    remove_temporaries(layout.keys, "removed_paragraphs")
    status = cluster_status(
        int(sum(counts)),
        np.concatenate([f["exact"] for f in found], axis=1) if dedup["exact"] else None,
        np.concatenate([f["near"] for f in found], axis=1) if dedup["near"] is not None else None,
    )
    removed = np.sort(np.concatenate([f["paragraphs"] for f in found]))
    seconds = time.process_time() - start + sum(float(f["seconds"]) for f in found)
    _write_json(layout.keys / "dedup.stats.json", {"seconds": seconds})
    for name, array in (("removed_paragraphs", removed), ("status", status)):
        with atomic_path(layout.keys / f"{name}.npy") as temp, open(temp, "wb") as f:
            np.save(f, array)


def write_shard(config: dict[str, Any], i: int, offset: int) -> None:
    """Phase 3 for shard i: copy it to clean/ without the duplicates and repeated paragraphs."""
    layout = Layout(config["output"])
    remove_temporaries(layout.clean, f"shard-{i:05d}")
    start = time.process_time()
    status = np.load(layout.keys / "status.npy", mmap_mode="r")
    removed = np.load(layout.keys / "removed_paragraphs.npy", mmap_mode="r")
    stats = StageStats()
    with (
        open(layout.shard(layout.filtered, i), encoding="utf-8") as src,
        atomic_path(layout.shard(layout.clean, i)) as temp,
        open(temp, "w", encoding="utf-8") as out,
    ):
        dropped = set()  # ids of this shard's dropped documents, whose augmented copies go too
        for local, line in enumerate(src):
            doc = Document.from_json(line)
            stats.docs_in += 1
            stats.bytes_in += utf8_size(doc.text)
            reason = DROP_REASONS.get(int(status[offset + local]))
            if reason is None and doc.meta.get("augmented_from") in dropped:
                reason = "source_dropped"
            if reason is None:
                reason = _remove_paragraphs(doc, offset + local, removed, stats)
            if reason is not None:
                stats.drops[reason] += 1
                dropped.add(doc.id)
                continue
            stats.docs_out += 1
            stats.bytes_out += utf8_size(doc.text)
            out.write(doc.to_json() + "\n")
    stats.seconds = time.process_time() - start
    _write_json(layout.shard(layout.clean, i, ".stats.json"), {"stages": {"dedup": stats.to_dict()}})


def _remove_paragraphs(doc: Document, index: int, removed: npt.NDArray[np.uint64], stats: StageStats) -> str | None:
    base = np.uint64(index << PARAGRAPH_BITS)
    lo, hi = np.searchsorted(removed, [base, base + np.uint64(1 << PARAGRAPH_BITS)])
    if lo == hi:
        return None
    drop = {int(p - base) for p in removed[lo:hi]}
    stats.counts["paragraphs_removed"] += len(drop)
    doc.text = "\n\n".join(p for j, p in enumerate(split_paragraphs(doc.text)) if j not in drop)
    return None if doc.text.strip() else "empty_after_paragraph_dedup"


def _prepare(config: dict[str, Any], num_tasks: int) -> tuple[Layout, list[dict[str, Any]]]:
    """Check the output directory belongs to this config and plan shards (once: a rerun, and every
    task of a multi-task job, works on the same shards). A one-task job also deletes what a killed
    run left half-written; tasks of a multi-task job each clean up their own files as they go."""
    layout = Layout(config["output"])
    saved, plan = layout.root / "config.json", layout.root / "shards.json"
    if saved.exists() and _read_json(saved) != config:
        raise UserError(f"{layout.root} holds a job with another config; use a new output directory or delete it")
    if plan.exists():
        shards = _read_json(plan)
    else:
        shards = [s.to_dict() for s in plan_shards(config["inputs"], config["shard_bytes"])]
    for directory in (layout.root, layout.filtered, layout.keys, layout.clean):
        directory.mkdir(parents=True, exist_ok=True)
    if num_tasks == 1:
        remove_temporaries(layout.root)
    for path, value in ((saved, config), (plan, shards)):
        if not path.exists():
            _write_json(path, value)
    return layout, shards


def _run_all(
    pool: ProcessPoolExecutor | None, fn: Callable[..., object], tasks: Sequence[tuple[Any, ...]], description: str
) -> None:
    """Run fn(*task) for each task, in the pool or (pool None) here, with a progress bar."""
    with tqdm(total=len(tasks), desc=description, unit="shard", disable=None) as bar:
        if pool is None:
            for task in tasks:
                fn(*task)
                bar.update()
            return
        for future in as_completed([pool.submit(fn, *task) for task in tasks]):
            future.result()
            bar.update()


PHASES = ("filter", "merge", "cluster", "write", "report")


def _check_tasks(task: int, num_tasks: int, phase: str) -> None:
    if num_tasks < 1 or not 0 <= task < num_tasks:
        raise UserError(f"--task must be in 0..--num-tasks-1 and --num-tasks >= 1; got task {task} of {num_tasks}")
    if phase != "all" and phase not in PHASES:
        raise UserError(f"unknown phase {phase!r}: use one of {', '.join(PHASES)} (or all, for a one-task job)")
    if phase == "all" and num_tasks > 1:
        raise UserError(
            f"a job of {num_tasks} tasks runs phase by phase: give --phase {'|'.join(PHASES)} "
            "(launch/data_clean.sbatch runs them in order)"
        )


def run_pipeline(
    config: dict[str, Any] | str | Path,
    overrides: Mapping[str, Any] | None = None,
    show: Callable[[str], object] = print,
    task: int = 0,
    num_tasks: int = 1,
    phase: str = "all",
) -> dict[str, StageStats] | None:
    """Run (or finish) a cleaning job, or one task's part of one phase of it; returns {stage:
    StageStats} of the whole job and writes report.json/.png once the report phase runs.

    A multi-task job (e.g. a SLURM array) runs the phases in order, each over all tasks:
    filter (task I filters shards I, I+N, ...), merge (task I finds the duplicate pairs of key
    range I of N), cluster (one task: clusters, the status of every document), write (task I
    writes its shards without their duplicates), report (one task). Every unit of work is skipped
    when its output exists, so a killed task is rerun alone."""
    config = load_config(config, overrides)
    _check_tasks(task, num_tasks, phase)
    start = time.perf_counter()
    layout, shards = _prepare(config, num_tasks)
    _build_stages(json.dumps(config["stages"]))  # fail on a bad stage before any worker starts
    _augmenter(json.dumps(config["augment"]))
    dedup, phases = config["dedup"], PHASES if phase == "all" else (phase,)
    mine = [i for i in range(len(shards)) if i % num_tasks == task]
    out_dir = layout.filtered if dedup else layout.clean
    workers = min(int(config["workers"]), max(len(mine), 1))
    # Workers fork from one clean server process that imported this module once: cheaper than a
    # fresh interpreter per worker, and safe for stages running torch (unlike a fork of this process).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(workers, mp_context=context) if workers > 1 else nullcontext() as pool:
        if "filter" in phases:
            _run_all(
                pool,
                filter_shard,
                [(config, i, shards[i]) for i in mine if not layout.shard(out_dir, i, ".stats.json").exists()],
                "filter",
            )
        if dedup and {"merge", "cluster", "write"} & set(phases):
            counts = [f["documents"] for f in _shard_stats(layout, out_dir, len(shards), "filter")]
            if "merge" in phases and not _pairs_file(layout, task, num_tasks).exists():
                merge_range(config, counts, task, num_tasks)
            if "cluster" in phases and not (layout.keys / "status.npy").exists():
                cluster(config, counts, num_tasks)
            if "write" in phases:
                if not (layout.keys / "status.npy").exists():
                    raise UserError("dedup: the cluster phase has not finished; run it before the write phase")
                offsets = np.cumsum([0] + counts)
                _run_all(
                    pool,
                    write_shard,
                    [
                        (config, i, int(offsets[i]))
                        for i in mine
                        if not layout.shard(layout.clean, i, ".stats.json").exists()
                    ],
                    "dedup",
                )
    if "report" not in phases:
        return None
    stats = _job_stats(layout, len(shards), dedup)
    wall = time.perf_counter() - start
    report.save_json(stats, wall, layout.root / "report.json")
    report.save_funnel(stats, layout.root / "report.png")
    show(report.format_table(stats, wall))
    return stats


def _shard_stats(layout: Layout, directory: Path, n_shards: int, phase: str) -> list[dict[str, Any]]:
    paths = [layout.shard(directory, i, ".stats.json") for i in range(n_shards)]
    if missing := [i for i, path in enumerate(paths) if not path.exists()]:
        raise UserError(f"the {phase} phase has not finished shards {missing}; run their tasks first")
    return [_read_json(path) for path in paths]


def _job_stats(layout: Layout, n_shards: int, dedup: dict[str, Any] | None) -> dict[str, StageStats]:
    """{stage: StageStats} of the whole job, from what every phase saved."""
    first = _shard_stats(layout, layout.filtered if dedup else layout.clean, n_shards, "filter")
    stats = report.merge({n: StageStats.from_dict(s) for n, s in f["stages"].items()} for f in first)
    if dedup:
        clustering = layout.keys / "dedup.stats.json"
        stats["dedup"].seconds += _read_json(clustering)["seconds"] if clustering.exists() else 0.0
        for written in _shard_stats(layout, layout.clean, n_shards, "write"):
            stats["dedup"].add(StageStats.from_dict(written["stages"]["dedup"]))
    return stats
