"""Training checkpoints: atomic, verified, pruned, and resumable on any number of ranks.

Layout of `OUT_DIR/checkpoints/`:
    config.json, tokenizer files, run_config.yaml   the model config and tokenizer (for export)
    global_step{N}/                                 one complete checkpoint:
        *model_states.pt, *optim_states.pt          DeepSpeed's files (ZeRO-partitioned states)
        llmstack_state.json                         step, consumed samples, counters, run config
        rng_rank{R}.json                            rank R's random-number states
        data_rank{R}.json                           rank R's place in a streaming data mixture
        experts_ep_rank{R}.pt                       expert-parallel rank R's experts (.experts;
                                                    experts_tp_rank{T}_ep_rank{R}.pt with tensor parallelism,
                                                    experts_pp_rank{P}_ep_rank{R}.pt per pipeline stage)
        momentum.pt                                 a contrastive run's MoCo key encoder and queue
                                                    (rank 0's; every rank holds the same)
        manifest.json                               every other file's size and CRC-32
    .tmp-global_step{N}/                            a save in progress; never loaded
    latest                                          the newest complete checkpoint's tag

Saving: each rank writes its files under the temporary name; once every rank has finished (they
exchange their file lists), rank 0 writes the manifest, renames the directory, then updates
`latest` and deletes old checkpoints (keeping the last `keep_last`, every `keep_every`-th step,
and always the newest). A crash at any moment leaves the previous checkpoints as they were. A
write that fails on any rank fails the checkpoint on all of them: the temporary directory is
removed and the save retried `save_retries` times before the run stops with CheckpointSaveError.
With `async_save` the ranks only wait for the in-memory copy; a writer thread does the rest.

Resuming picks the newest checkpoint whose files match its manifest and reports the ones it
skips. Packed shards need only the consumed-sample count (llmstack.data.blocks), so a checkpoint
resumes on another layout too (other data-, tensor- or pipeline-parallel sizes), through
DeepSpeed's universal format (.universal); a streaming mixture (llmstack.data.stream) continues
from each rank's saved place, on the same data-parallel size. A checkpoint whose experts are split
(expert parallelism) resumes on the same expert-, data-, tensor- and pipeline-parallel sizes only.
"""

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import yaml

from llmstack.compat.deepspeed import install_checkpoint_engine, is_zero3_partitioned
from llmstack.errors import UserError
from llmstack.optim import optimizer_state_gathered
from llmstack.safe_load import load_tensors, safe_loading

from ..config import TrainConfig
from ..rng import rng_state, set_rng_state
from .compression import load_compression_state, save_compression_state
from .engine import ManifestCheckpointEngine
from .experts import ExpertShard, load_local_experts, local_experts, saved_expert_parallel_size
from .files import (
    LATEST_FILE,
    NO_MANIFEST,
    CorruptManifest,
    file_problems,
    fsync_dir,
    has_manifest,
    read_manifest,
    write_durable,
    write_manifest,
)
from .resume import SavedLayout, describe_layout, plan_resume
from .universal import (
    convert_to_universal,
    link_module_names,
    loading_universal,
    saved_layout,
    saved_weights_partitioned,
    universal_checkpoint_info,
)

logger = logging.getLogger(__name__)

TAG = re.compile(r"global_step(\d+)$")
TEMP_PREFIX = ".tmp-"
UNIVERSAL_DIR = TEMP_PREFIX + "universal"  # an elastic resume's conversion, deleted once loaded
STATE_FILE = "llmstack_state.json"
RNG_FILE = "rng_rank{}.json"
DATA_FILE = "data_rank{}.json"
MOMENTUM_FILE = "momentum.pt"


class CheckpointSaveError(UserError):
    """A checkpoint could not be written; the previous one is intact."""


@dataclass
class Resumed:
    tag: str
    step: int
    consumed_samples: int
    counters: dict
    data_state: dict | None  # this rank's saved data-stream state, if it saved one


def tag_step(name: str) -> int | None:
    match = TAG.fullmatch(name)
    return int(match.group(1)) if match else None


def complete_tags(root: str) -> list[str]:
    """Tags of the checkpoints under `root` that finished saving (they have a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    tags = [n for n in os.listdir(root) if tag_step(n) is not None and os.path.isdir(os.path.join(root, n))]
    return sorted((t for t in tags if has_manifest(os.path.join(root, t))), key=tag_step)  # type: ignore[arg-type]  # every tag has a step


def tags_to_keep(steps: Iterable[int], keep_last: int, keep_every: int) -> set[int]:
    """The steps whose checkpoints survive pruning: the last `keep_last` (all when 0), the
    multiples of `keep_every` (none when 0), and always the newest."""
    steps = sorted(steps)
    keep = set(steps[-keep_last:] if keep_last else steps)
    keep.update(s for s in steps if keep_every and s % keep_every == 0)
    keep.update(steps[-1:])
    return keep


class CheckpointManager:
    """Saves and loads the checkpoints of one run, on every rank (all calls are collective)."""

    def __init__(
        self,
        directory: str,
        engine: Any,
        cfg: TrainConfig,
        run_config: dict[str, Any],
        model_files: Sequence[Any] = (),
        experts: ExpertShard | None = None,
        momentum: Any = None,
    ) -> None:
        """`experts`: this rank's share of the experts when they are split (expert parallelism);
        `momentum`: a MoCo key encoder and queue (llmstack.training.momentum), saved and restored."""
        for key in ("save_interval", "keep_last", "keep_every", "save_retries"):
            minimum = 1 if key == "save_interval" else 0
            if getattr(cfg, key) < minimum:
                raise UserError(f"train.{key} must be at least {minimum}; got {getattr(cfg, key)}")
        self.directory = directory
        self.engine = engine
        self.cfg = cfg
        self.run_config = run_config
        self.model_files = model_files  # objects with save_pretrained(dir): model config, tokenizer
        self.experts = experts
        self.momentum = momentum
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # File lists and commits go over their own gloo group: the writer thread uses it while
        # training goes on in the default group, and it takes Python objects on any backend.
        self.group = dist.new_group(backend="gloo")
        self.universal_info = universal_checkpoint_info(engine.module, self.group)
        self.files = ManifestCheckpointEngine(background=cfg.async_save)
        install_checkpoint_engine(engine, self.files)
        self.pending: tuple[str, Future[list[str]]] | None = None  # a save still being written in the background
        self._model_files_written = False
        self.last_save = time.monotonic()

    @property
    def layout(self) -> dict[str, int]:
        """This run's parallel sizes, as saved in each checkpoint's state. The data-parallel size is
        DeepSpeed's, whose replicas (and ZeRO partitions) are data x context-parallel ranks."""
        return {
            "data_parallel_size": self.engine.dp_world_size,
            "tensor_parallel_size": self.cfg.tensor_parallel_size,
            "pipeline_parallel_size": self.cfg.pipeline_parallel_size,
            "expert_parallel_size": self.cfg.expert_parallel_size,
            "context_parallel_size": self.cfg.context_parallel_size,
        }

    # ---- saving

    def due(self, step: int) -> bool:
        """Whether this rank thinks a save is due (the step interval, or the wall-clock one)."""
        minutes = self.cfg.save_interval_minutes
        return step % self.cfg.save_interval == 0 or bool(minutes and time.monotonic() - self.last_save >= 60 * minutes)

    def save(self, step: int, consumed_samples: int, counters: dict, data_state: dict | None = None) -> None:
        """Collective: checkpoint `step`; `data_state` is this rank's place in a data stream (JSON)."""
        self.wait()
        self.last_save = time.monotonic()
        tag = f"global_step{step}"
        state = {
            "step": step,
            "consumed_samples": consumed_samples,
            **self.layout,
            "counters": counters,
            "run_config": self.run_config,
        }
        for attempt in range(1, self.cfg.save_retries + 2):
            result = self._start(tag, state, data_state)
            if self.cfg.async_save:
                self.pending = (tag, result)
                return
            errors = result.result()
            if not errors:
                return
            if attempt <= self.cfg.save_retries:
                if self.rank == 0:
                    logger.warning("saving %s failed (%s); retrying in %gs", tag, errors[0], self.cfg.save_retry_wait_s)
                time.sleep(self.cfg.save_retry_wait_s)
        raise self._save_error(tag, errors, attempts=self.cfg.save_retries + 1)

    def wait(self) -> None:
        """Let a background save finish; raises CheckpointSaveError (on every rank) if it failed."""
        if self.pending is None:
            return
        (tag, result), self.pending = self.pending, None
        errors = result.result()
        if errors:
            raise self._save_error(tag, errors, attempts=1)

    def _save_error(self, tag: str, errors: Sequence[str], attempts: int) -> CheckpointSaveError:
        previous = complete_tags(self.directory)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        return CheckpointSaveError(
            f"could not save checkpoint {tag}{tries}: {errors[0]}"
            + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else "")
            + f"; {self._disk_full(previous)}{kept}. Free disk space or fix the error, then rerun with --resume auto"
        )

    def _disk_full(self, previous: Sequence[str]) -> str:
        """Says the disk is full when it holds less than the last checkpoint took: a full disk
        does not always say so (torch.save reports a short write as `unexpected pos`)."""
        try:
            files = read_manifest(os.path.join(self.directory, previous[-1])) if previous else None
            free = shutil.disk_usage(self.directory).free
        except (OSError, CorruptManifest):
            return ""
        needed = sum(entry["bytes"] for entry in (files or {}).values())
        if free >= needed:
            return ""
        return (
            f"the disk is full: {self.directory} has {free / 2**20:.2f} MiB free, and the last checkpoint "
            f"took {needed / 2**20:.2f} MiB; "
        )

    def _start(self, tag: str, state: dict[str, Any], data_state: dict[str, Any] | None) -> Future[list[str]]:
        """Write this rank's files under the temporary name; returns a Future of the commit's errors."""
        temp = os.path.join(self.directory, TEMP_PREFIX + tag)
        errors = []  # failures before DeepSpeed's save; raising here would leave the other ranks waiting
        if self.rank == 0:
            try:
                self._prepare_directory()
            except OSError as e:
                errors.append(f"{self.directory}: {e}")
        dist.barrier(group=self.group)
        # DeepSpeed's MoE save reserves the key; a checkpoint with split experts is not converted.
        client_state = {"universal_checkpoint_info": self.universal_info} if self.experts is None else {}
        try:
            with optimizer_state_gathered(self.engine):
                self.engine.save_checkpoint(
                    self.directory, tag=TEMP_PREFIX + tag, client_state=client_state, save_latest=False
                )
        except OSError as e:
            # A write outside the checkpoint engine (DeepSpeed copying its recovery scripts on rank
            # 0) failed half-way through DeepSpeed's collective save: this rank cannot rejoin the
            # others, so it stops here and the launcher stops the rest.
            raise self._save_error(tag, [str(e)], attempts=1) from e
        if self.rank == 0:
            self._write_json(os.path.join(temp, STATE_FILE), state)
        self._write_json(os.path.join(temp, RNG_FILE.format(self.rank)), rng_state())
        if data_state is not None:
            self._write_json(os.path.join(temp, DATA_FILE.format(self.rank)), data_state)
        save_compression_state(self.engine, temp, self.files.save)
        if self.experts is not None:
            experts = local_experts(self.engine.module)  # every rank: ZeRO-3 gathers them
            if self.experts.writer:
                self.files.save(experts, os.path.join(temp, self.experts.file_name))
        if self.momentum is not None and self.rank == 0:
            self.files.save(self.momentum.state_dict(), os.path.join(temp, MOMENTUM_FILE))
        return self.files.finish(lambda written, write_errors: self._commit(temp, tag, written, errors + write_errors))

    def _write_json(self, path: str, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.files.write(path, lambda f: f.write(data))

    def _prepare_directory(self) -> None:
        """Rank 0, before each save: remove what saves that died half-way left, and (once per run)
        write the model config, tokenizer and run config that export needs."""
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            if name.startswith(TEMP_PREFIX):
                shutil.rmtree(os.path.join(self.directory, name))
        if not self._model_files_written:
            for item in self.model_files:
                item.save_pretrained(self.directory)
            with open(os.path.join(self.directory, "run_config.yaml"), "w") as f:
                yaml.safe_dump(self.run_config, f, sort_keys=False)
            self._model_files_written = True

    def _commit(self, temp: str, tag: str, written: Mapping[str, Any], errors: list[str]) -> list[str]:
        """Collective: make the checkpoint visible if every rank wrote its files; returns the errors."""
        mine = ({os.path.relpath(p, temp): entry for p, entry in written.items()}, errors)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        errors = [e for _, rank_errors in everyone for e in rank_errors]
        if self.rank == 0 and not errors:
            try:
                self._publish(temp, tag, {name: entry for files, _ in everyone for name, entry in files.items()})
            except OSError as e:  # the manifest, the rename, `latest` or the pruning
                errors = [f"publishing {tag}: {e}"]
        if self.rank == 0 and errors:
            shutil.rmtree(temp, ignore_errors=True)
        outcome = [errors]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        return outcome[0]

    def _publish(self, temp: str, tag: str, files: Mapping[str, Mapping[str, int | str]]) -> None:
        write_manifest(temp, files)
        final = os.path.join(self.directory, tag)
        if os.path.exists(final):  # the same step saved again (after a rollback)
            shutil.rmtree(final)
        os.rename(temp, final)
        fsync_dir(self.directory)
        write_durable(os.path.join(self.directory, LATEST_FILE), tag.encode())
        self._prune()

    def _prune(self) -> None:
        tags = complete_tags(self.directory)
        keep = tags_to_keep([tag_step(t) for t in tags], self.cfg.keep_last, self.cfg.keep_every)  # type: ignore[misc]  # every tag has a step
        for tag in tags:
            if tag_step(tag) not in keep:
                shutil.rmtree(os.path.join(self.directory, tag))

    # ---- loading

    def load(
        self, which: str = "auto", trust: bool = False, check: Callable[[int | None], None] | None = None
    ) -> Resumed | None:
        """Restore the engine, the RNG states and the progress from a checkpoint.

        `which`: "auto" (the newest usable checkpoint of this run, or None when there is none), a
        checkpoint directory (OUT_DIR/checkpoints) or one checkpoint in it (.../global_stepN).
        `trust`: also accept a checkpoint without an llmstack manifest; files that contradict their
        manifest are never loaded. `check(saved data-parallel size, None if unknown)` runs before
        anything is loaded and raises to refuse the checkpoint; the size counts the ranks reading
        distinct samples (a context-parallel group reads the same ones, and counts once).
        """
        self.wait()
        root, tags = self._candidates(which)
        if not tags:
            if which == "auto":
                return None
            raise UserError(f"no checkpoint in {which}: expected global_stepN directories with a manifest.json")
        rejected = []
        for tag in tags:
            problems = self._problems(os.path.join(root, tag))
            if not problems or (trust and problems == [NO_MANIFEST]):
                break
            rejected.append(f"{tag}: {'; '.join(problems)}")
            if self.rank == 0:
                logger.warning("skipping checkpoint %s: %s", tag, "; ".join(problems))
        else:
            hint = (
                " (pass --trust-checkpoint to load one without a manifest)"
                if any(NO_MANIFEST in r for r in rejected)
                else ""
            )
            raise UserError(f"no usable checkpoint in {root}{hint}: " + " | ".join(rejected))
        if rejected and self.rank == 0:
            logger.warning("resuming from %s instead", tag)
        tag_dir = os.path.join(root, tag)
        state = read_json(os.path.join(tag_dir, STATE_FILE))  # None: a trusted checkpoint written elsewhere
        zero_data, zero_model = saved_layout(tag_dir)
        saved = SavedLayout(
            tag, state, zero_data, zero_model, saved_expert_parallel_size(tag_dir), saved_weights_partitioned(tag_dir)
        )
        if check is not None:
            check(saved_data_ranks(state) if state else zero_data or None)
        self._load_engine(root, saved)
        if self.experts is not None:
            load_local_experts(self.engine.module, os.path.join(tag_dir, self.experts.file_name))
        if self.momentum is not None:
            self._load_momentum(tag_dir)
        return self._restore(tag_dir, tag, state)

    def _load_momentum(self, tag_dir: str) -> None:
        path = os.path.join(tag_dir, MOMENTUM_FILE)
        if not os.path.isfile(path):
            raise UserError(f"checkpoint {tag_dir} has no MoCo queue ({MOMENTUM_FILE}): resume with train.queue_size 0")
        try:
            self.momentum.load_state_dict(load_tensors(path))
        except ValueError as e:
            raise UserError(f"checkpoint {tag_dir}: {e}") from None

    def _candidates(self, which: str) -> tuple[str, list[str]]:
        """(checkpoint root, tags to try, newest first)."""
        path = self.directory if which == "auto" else os.path.normpath(which)
        if which != "auto" and not os.path.isdir(path):
            raise UserError(f"checkpoint {which} not found")
        if tag_step(os.path.basename(path)) is not None:
            return os.path.dirname(path), [os.path.basename(path)]
        if not os.path.isdir(path):
            return path, []
        tags = [n for n in os.listdir(path) if tag_step(n) is not None and os.path.isdir(os.path.join(path, n))]
        return path, sorted(tags, key=tag_step, reverse=True)  # type: ignore[arg-type]  # every tag has a step

    def _problems(self, tag_dir: str) -> list[str]:
        """Collective: the checkpoint's problems, each rank checking a share of its files."""
        try:
            files = read_manifest(tag_dir)
        except CorruptManifest as e:
            return [str(e)]
        if files is None:
            return [NO_MANIFEST]
        names = sorted(files)[self.rank :: self.world_size]
        mine = file_problems(tag_dir, {n: files[n] for n in names})
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return [p for rank_problems in everyone for p in rank_problems]

    def _load_engine(self, root: str, saved: SavedLayout) -> None:
        partitioned = any(is_zero3_partitioned(p) for p in self.engine.module.parameters())
        plan = plan_resume(saved, self.layout, self.engine.mp_world_size, partitioned)  # refuses what cannot be carried
        if plan == "direct":
            with safe_loading():
                loaded, _ = self.engine.load_checkpoint(root, tag=saved.tag)
            load_compression_state(self.engine, os.path.join(root, saved.tag))
        else:  # the error feedback, if any, restarts from zero
            loaded = self._load_on_another_layout(root, saved)
        if loaded is None:
            raise UserError(f"DeepSpeed could not load checkpoint {os.path.join(root, saved.tag)}")

    def _load_on_another_layout(self, root: str, saved: SavedLayout) -> str | None:
        """Convert the checkpoint to DeepSpeed's universal format and load that; the conversion is
        deleted afterwards, whether the load worked or not."""
        tag = saved.tag
        here = describe_layout(self.layout, self.engine.dp_world_size, self.engine.mp_world_size)
        universal_root = os.path.join(self.directory, UNIVERSAL_DIR)  # ours to write, wherever `root` is
        try:
            error = None
            if self.rank == 0:
                logger.warning(
                    "%s was saved with %s, resuming with %s: converting it to DeepSpeed's universal checkpoint",
                    tag,
                    saved.describe(),
                    here,
                )
                shutil.rmtree(universal_root, ignore_errors=True)
                os.makedirs(universal_root)
                try:
                    convert_to_universal(
                        os.path.join(root, tag), os.path.join(universal_root, tag), self._num_hidden_layers()
                    )
                except UserError as e:
                    error = str(e)
            outcome = [error]
            dist.broadcast_object_list(outcome, src=0, group=self.group)
            if outcome[0] is not None:
                raise UserError(outcome[0])
            link_module_names(os.path.join(universal_root, tag), self.engine.module)
            dist.barrier(group=self.group)
            with loading_universal(self.engine), safe_loading():
                loaded, _ = self.engine.load_checkpoint(universal_root, tag=tag)
            return loaded
        finally:
            dist.barrier(group=self.group)
            if self.rank == 0:
                shutil.rmtree(universal_root, ignore_errors=True)

    def _num_hidden_layers(self) -> int:
        return int(self.engine.module.config.num_hidden_layers)

    def _restore(self, tag_dir: str, tag: str, state: dict[str, Any] | None) -> Resumed:
        if state is None:  # a trusted checkpoint from elsewhere: DeepSpeed's own counts
            state = {"step": self.engine.global_steps, "consumed_samples": self.engine.global_samples, "counters": {}}
        # A rank that did not exist when the checkpoint was saved takes rank 0's states (all ranks
        # start from the same seed).
        rng_path = os.path.join(tag_dir, RNG_FILE.format(self.rank))
        if not os.path.isfile(rng_path):
            rng_path = os.path.join(tag_dir, RNG_FILE.format(0))
        if os.path.isfile(rng_path):
            set_rng_state(read_json(rng_path))
        data_path = os.path.join(tag_dir, DATA_FILE.format(self.rank))
        if not os.path.isfile(data_path):  # a stream refuses another rank's place; a packed mixture's is shared
            data_path = os.path.join(tag_dir, DATA_FILE.format(0))
        data_state = read_json(data_path)
        return Resumed(tag, state["step"], state["consumed_samples"], state["counters"], data_state)


def saved_data_ranks(state: Mapping[str, Any]) -> int:
    """The data-parallel size of a checkpoint's run, its context-parallel groups counted once (a
    state saved before llmstack recorded the context-parallel size had none)."""
    return int(state["data_parallel_size"]) // int(state.get("context_parallel_size", 1))


def read_json(path: str) -> Any:
    """The JSON object in `path`, or None when there is no such file."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
