"""The pretraining loop: a plain llmstack model trained by a DeepSpeed engine.

Read top to bottom: build (process group, tokenizer, model, engine, data), then `train()` runs
optimizer steps; each step runs `grad_accum_steps` micro-batches through the engine, which does
gradient accumulation, ZeRO partitioning, clipping, loss scaling and the LR schedule. Every
`log_interval` steps the loss (averaged over data-parallel ranks) and throughput are logged,
every `eval_interval` steps the validation loss, every `save_interval` steps a checkpoint.

Data are addressed by the number of samples consumed so far: for packed shards
(llmstack.data.blocks) that is all a checkpoint needs to continue exactly, on the same or another
number of ranks; a streaming mixture (llmstack.data.stream) also saves each rank's place in it and
continues from there, on the same number of data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from llmstack.compat.deepspeed import full_shape
from llmstack.data.blocks import MixedBlocks, PackedBlocks, SampleSchedule
from llmstack.data.mixture import token_shares, unbalanced
from llmstack.data.mlm import MaskedBlocks, MaskedStream, Masking
from llmstack.data.pairs import PairData
from llmstack.data.prefetch import Prefetcher
from llmstack.data.span_corruption import SpanCorruptedBlocks, SpanCorruption, sentinel_ids
from llmstack.data.stream import MixtureStream, check_data_parallel_size
from llmstack.data.tokenizer import load_tokenizer
from llmstack.errors import UserError
from llmstack.models import LLMStackConfig
from llmstack.models.moe import RouterStatsWindow, moe_layer_indices
from llmstack.models.mup import lr_scale
from llmstack.monitor import MetricsLogger
from llmstack.monitor.redact import redact_secrets
from llmstack.monitor.stragglers import StragglerWatch, own_time
from llmstack.monitor.throughput import StepTimer, ThroughputMeter, memory_gb
from llmstack.parallel import (
    Topology,
    model_parallel_seed,
)
from llmstack.parallel.checkpoint import plain_names
from llmstack.parallel.comm_stats import CommStats
from llmstack.parallel.layout import check_layout

from .checkpoint.experts import ExpertShard
from .checkpoint.manager import CheckpointManager
from .config import DataConfig, RunConfig, run_layout
from .construct import build_model, mask_token_id
from .contrastive import held_out_batches
from .distributed import init_distributed
from .ds_config import complete_ds_config, load_ds_config
from .expert_parallel import check_expert_count
from .faults import FaultGuard
from .momentum import MomentumEncoder
from .multitask import MultitaskData, MultitaskModel, TaskWeighting, build_multitask_data
from .precision import LossScaleGuard, check_precision_supported, loss_scale_metrics
from .schedule import warmup_cosine
from .train_model import (
    UNSHIFTED_OBJECTIVES,
    apply_layout,
    build_engine,
    gather_over,
    input_tokens,
    scores_every_target,
    sum_over,
    target_tokens,
    train_model_for,
)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # types only: DeepSpeed's internals are used through llmstack.compat
    pass


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_train_data(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    objective: str = "causal",
    samples_per_step: int = 1,
    tasks: Sequence[Mapping[str, Any]] = (),
) -> MixtureStream | PackedBlocks | MixedBlocks | PairData | MultitaskData:
    """Pre-tokenized packed shards (data.train: prefixes, or a weighted mixture of named sources
    of prefixes) or a weighted streaming mixture of raw documents (data.sources), as `objective`
    trains on them, or a contrastive run's JSONL pairs (llmstack.data.pairs); all serve
    `micro_batches(consumed_samples, micro, dp_rank, dp_size)`. A mixture follows data.schedule
    over training steps of `samples_per_step` samples (the global batch). A multi-task run reads
    each of `tasks`' data (llmstack.training.multitask)."""
    if objective == "contrastive":
        return PairData(data.train, tokenizer, data.seq_len, seed=data.seed)
    if objective == "multitask":
        blocks = lambda prefixes, kind, seed: packed_blocks(prefixes, data, tokenizer, kind, seed)  # noqa: E731
        return build_multitask_data(tasks, tokenizer, data.seq_len, data.seed, blocks)
    if bool(data.train) == bool(data.sources):
        raise UserError("give exactly one of data.train (packed shards) and data.sources (a mixture of raw documents)")
    mixture: dict[str, Any] = dict(weight_by=data.weight_by, schedule=data.schedule, samples_per_step=samples_per_step)
    if data.document_masking:  # batches then carry their documents (llmstack.data.documents)
        mixture["document_masking"] = True
    if data.sources:
        if objective == "mlm":
            masked = masking(data, tokenizer)
            return MaskedStream(data.sources, tokenizer, data.seq_len, seed=data.seed, masking=masked, **mixture)
        return MixtureStream(data.sources, tokenizer, data.seq_len, seed=data.seed, **mixture)
    if any(isinstance(entry, Mapping) for entry in data.train):
        return MixedBlocks(data.train, data.seq_len, seed=data.seed, **mixture)
    return packed_blocks(data.train, data, tokenizer, objective, seed=data.seed)


def span_corruption(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> SpanCorruption:
    """The span-corruption objective's corruption of this run's samples, with the tokenizer's sentinels."""
    if tokenizer.eos_token_id is None:
        raise UserError("span corruption ends inputs and targets with EOS; the tokenizer has no eos_token")
    return SpanCorruption(
        sentinel_ids(tokenizer), tokenizer.eos_token_id, data.noise_density, data.mean_noise_span_length, seed
    )


def masking(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int | None = None) -> Masking:
    """The masked-LM objective's masking of this run's samples (never at the tokenizer's special tokens)."""
    return Masking(
        mask_token_id(tokenizer),
        len(tokenizer),
        data.mlm_probability,
        data.seed if seed is None else seed,
        tuple(tokenizer.all_special_ids),
    )


def packed_blocks(
    prefixes: list,
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    objective: str,
    seed: int,
    shuffle: bool = True,
) -> PackedBlocks:
    """Packed shards as `objective` trains on them: next-token blocks, masked blocks (mlm) or
    span-corrupted blocks (span_corruption)."""
    if objective == "span_corruption":
        return SpanCorruptedBlocks(prefixes, data.seq_len, span_corruption(data, tokenizer, seed), shuffle)
    if objective == "mlm":
        m = masking(data, tokenizer, seed)
        return MaskedBlocks(
            prefixes,
            data.seq_len,
            m.mask_token_id,
            m.vocab_size,
            m.probability,
            seed,
            shuffle,
            m.special_ids,
            document_masking=data.document_masking,
        )
    return PackedBlocks(prefixes, data.seq_len, seed=seed, shuffle=shuffle, document_masking=data.document_masking)


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None) -> list[dict[str, Any]]:
    """Weight decay on matrices and embeddings; none on norm gains and biases. Under µP (the model
    config's mup_base_width, width multiplier m; llmstack.models.mup) the hidden weights form a
    third group with learning rate lr / m and weight decay weight_decay x m, so that AdamW's decay
    per step (lr x weight_decay) is the base model's, as in the mup package's MuAdamW. A group's
    lr is its peak: the schedule (LambdaLR) scales every group's own lr by the same factor."""
    config = getattr(model, "config", None)  # a peft model's is its base model's
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    hidden: list[nn.Parameter] = []
    scale = 1.0  # one width multiplier per model
    names = plain_names(model)  # a pipeline's layers are numbered
    for name, p in model.named_parameters():
        name = names[name]
        if not p.requires_grad:
            continue
        ndim = len(full_shape(p))
        p_scale = lr_scale(name, ndim, config) if isinstance(config, LLMStackConfig) else 1.0
        if p_scale != 1.0:
            hidden.append(p)
            scale = p_scale
        else:
            (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if hidden:
        if lr is None:
            raise ValueError("param_groups of a µP model need the base learning rate (lr)")
        groups.append({"params": hidden, "weight_decay": weight_decay / scale, "lr": lr * scale})
    return groups


class Trainer:
    def __init__(
        self,
        run: RunConfig,
        ds_config_path: str | None = None,
        model: nn.Module | None = None,
        train_data: SampleSchedule | MixtureStream | MultitaskData | None = None,
        valid_data: SampleSchedule | None = None,
    ) -> None:
        """`model`, `train_data` and `valid_data` replace what the run config would build (fine-tuning
        passes a pretrained, possibly peft-wrapped model and prompt/response data)."""
        self.run = run
        cfg = run.train
        token_blocks = (PackedBlocks, MixedBlocks, MixtureStream, PairData, MultitaskData, type(None))
        raw_ds_config = load_ds_config(ds_config_path or cfg.ds_config)
        # Every combination rule is checked here, once, before any process group or model exists.
        layout = run_layout(
            run, raw_ds_config, variable_length=not all(isinstance(d, token_blocks) for d in (train_data, valid_data))
        )
        check_layout(layout)
        check_precision_supported(raw_ds_config, cfg.allow_emulated_bf16)

        self.rank, self.world_size = init_distributed(cfg.collective_timeout_s)
        self.topology = Topology(
            cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.expert_parallel_size, cfg.context_parallel_size
        )
        self.dp_rank, self.dp_size = self.topology.data_parallel_rank, self.topology.data_parallel_size
        self.layout = dataclasses.replace(layout, data=self.dp_size)
        self.ds_config = complete_ds_config(raw_ds_config, cfg, self.dp_size)

        self.tokenizer = load_tokenizer(run.data.tokenizer or run.model["init_from"])
        if train_data is None:
            train_data = build_train_data(run.data, self.tokenizer, cfg.objective, self.global_batch_size, cfg.tasks)
        if valid_data is None and run.data.valid and cfg.objective == "contrastive":
            valid_data = PairData(run.data.valid, self.tokenizer, run.data.seq_len, shuffle=False)
        elif valid_data is None and run.data.valid:
            valid_data = packed_blocks(run.data.valid, run.data, self.tokenizer, cfg.objective, seed=0, shuffle=False)
        self.train_data, self.valid_data = train_data, valid_data

        seed_everything(cfg.seed)
        # Same seed, same weights, whichever way the layout builds it (see .construct).
        if model is None:
            model = build_model(
                run.model,
                self.tokenizer,
                run.data.seq_len,
                self.ds_config,
                self.topology,
                encoder=self.layout.objective == "mlm",
                pooling=cfg.pooling if self.layout.objective == "contrastive" else None,
                multitask=self.multitask_fields(),
                encoder_decoder=self.layout.objective == "span_corruption",
            )
        self.model_config = cast(LLMStackConfig, model.config)  # a causal LM's config (peft forwards it)
        router_window = self.moe_window(self.model_config)
        # MoCo's key encoder starts as a copy of the model as built (llmstack.training.momentum)
        self.momentum = (
            MomentumEncoder(model, cfg.queue_size, cfg.momentum, cfg.seed) if layout.momentum_queue else None
        )
        model = apply_layout(model, self.layout, self.topology)
        model_parallel_seed(cfg.seed, self.topology)  # dropout streams per tensor-parallel rank
        lr_schedule = functools.partial(
            warmup_cosine, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps
        )
        groups = param_groups(model, cfg.weight_decay, cfg.lr)
        self.engine, self.scheduler = build_engine(
            model, self.layout, self.topology, self.ds_config, groups, lr_schedule
        )
        if self.rank == 0:
            logger.info("layout: %s", self.layout.describe())
        self.timer = StepTimer()
        self.model = train_model_for(
            self.layout,
            engine=self.engine,
            topology=self.topology,
            config=self.model_config,
            grad_accum_steps=cfg.grad_accum_steps,
            timer=self.timer,
            loss_scale_guard=LossScaleGuard(self.engine, patience=cfg.max_nonfinite_steps),
            router_window=router_window,
            **self.objective_parts(),
        )

        self.step = 0
        self.consumed_samples = 0
        self.batches: Prefetcher | None = None  # train_batches() makes it
        self.window_tokens = 0  # tokens this rank computed on since the last log
        self.checkpoints = CheckpointManager(
            os.path.join(cfg.out_dir, "checkpoints"),
            self.engine,
            cfg,
            redact_secrets(run.to_dict()),
            model_files=(self.model_config, self.tokenizer),
            experts=ExpertShard.of(self.topology),
            momentum=self.momentum,
        )
        self.guard = FaultGuard(cfg, fp16=self.train_dtype == torch.float16, device=self.engine.device)
        self.stopped_by: int | None = None  # the signal that ended training early (after a checkpoint), if any
        self.throughput = ThroughputMeter.from_config(
            run.monitor, self.model_config, run.data.seq_len, self.world_size, dtype=self.train_dtype
        )
        # With split experts, the bytes each collective moves in the step that ends a logging interval.
        self.comm_stats = CommStats() if self.topology.expert_parallel_size > 1 else None
        self.stragglers = StragglerWatch(cfg.straggler_factor, cfg.straggler_patience)
        self.metrics = MetricsLogger.from_config(
            run.monitor, cfg.out_dir, run_config=run.to_dict(), enabled=self.rank == 0, total_steps=cfg.max_steps
        )

    def multitask_fields(self) -> dict[str, Any] | None:
        """A multi-task run's model config fields: its tasks' heads and, under uncertainty
        weighting, learned log-variances (llmstack.models.multitask); None for other objectives."""
        cfg = self.run.train
        if cfg.objective != "multitask":
            return None
        heads = [{k: t[k] for k in ("name", "kind", "num_labels") if k in t} for t in cfg.tasks]
        return {"tasks": heads, "learn_task_variance": cfg.task_weighting == "uncertainty"}

    def objective_parts(self) -> dict[str, Any]:
        """What the objective's train model takes beyond the engine's (contrastive: InfoNCE's
        settings; multi-task: the tasks and their weighting)."""
        cfg = self.run.train
        if self.layout.objective == "multitask":
            weighting = "fixed" if cfg.task_weighting == "uncertainty" else cfg.task_weighting
            weights = [t["weight"] for t in cfg.tasks]
            return {
                "task_names": [t["name"] for t in cfg.tasks],
                "weighting": TaskWeighting(weighting, weights, cfg.dwa_temperature),
            }
        if self.layout.objective != "contrastive":
            return {}
        if self.momentum is not None:
            self.momentum.to(self.engine.device, self.train_dtype)
        return {"temperature": self.run.train.temperature, "momentum": self.momentum}

    def moe_window(self, config: LLMStackConfig) -> RouterStatsWindow | None:
        """Routing statistics of a mixture-of-experts model (None for a dense one)."""
        layers = moe_layer_indices(config) if isinstance(config, LLMStackConfig) else []
        check_expert_count(self.run.train.expert_parallel_size, config)
        if not layers:
            return None
        return RouterStatsWindow(layers, config.num_local_experts)

    @property
    def train_dtype(self) -> torch.dtype:
        if self.ds_config.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if self.ds_config.get("fp16", {}).get("enabled"):
            return torch.float16
        return torch.float32

    @property
    def replicas(self) -> int:
        """The ranks DeepSpeed averages gradients over: data x context-parallel ranks."""
        return self.dp_size * self.run.train.context_parallel_size

    @property
    def global_batch_size(self) -> int:
        return self.run.train.micro_batch_size * self.run.train.grad_accum_steps * self.dp_size

    def train(self) -> None:
        cfg = self.run.train
        batches = self.train_batches()
        if self.valid_data is not None and self.step == 0:
            self.metrics.log(0, self.evaluate())
        self.engine.train()
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        compiling = self.layout.compile  # the first step compiles
        # SIGTERM/SIGINT: save after the current step, then stop; the reader thread stops with training
        with self.guard, contextlib.closing(batches):
            while self.step < cfg.max_steps:
                step_start = time.perf_counter()
                with self.comm_measured(self.step + 1):
                    loss = self.train_step(batches)
                if compiling and self.rank == 0:
                    logger.info("first step, compiling the decoder blocks: %.1f s", time.perf_counter() - step_start)
                compiling = False
                self.step += 1
                self.consumed_samples += self.global_batch_size
                # All ranks agree on skipped steps, spikes, saves and signals.
                verdict = self.guard.after_step(
                    self.step, loss, self.engine.was_step_applied(), self.checkpoints.due(self.step)
                )
                if verdict.rollback:
                    self.roll_back()  # `batches` reads on from the current data position
                    continue
                window_loss, window_steps = window_loss + loss, window_steps + 1

                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    self.metrics.log(
                        self.step, self.interval_metrics(window_loss / window_steps, window_steps, window_start)
                    )
                    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
                if self.valid_data is not None and (self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps):
                    self.metrics.log(self.step, self.evaluate())
                if verdict.save or self.step == cfg.max_steps:
                    self.save_checkpoint()
                if verdict.stop_signal:
                    self.stopped_by = verdict.stop_signal
                    break
            self.checkpoints.wait()  # inside the guard: a signal now must not cut an async save short
        self.metrics.close()

    def train_batches(self) -> Prefetcher[torch.Tensor | dict[str, torch.Tensor]]:
        """This rank's micro-batches from the current data position, read ahead in a background thread;
        a streaming mixture's position is the one after the batch training last took (see Prefetcher)."""
        cfg = self.run.train
        self.batches = Prefetcher(
            self.train_data.micro_batches(self.consumed_samples, cfg.micro_batch_size, self.dp_rank, self.dp_size),
            depth=self.run.data.prefetch,
            snapshot=self.data_stream.state_dict if self.data_stream is not None else None,
        )
        return self.batches

    def train_step(self, batches: Iterator) -> float:
        """One optimizer step over grad_accum_steps micro-batches. Returns this rank's loss: its summed
        token loss over the step's mean target tokens per data-parallel rank, so that the mean over
        the ranks is the step's loss per target token (with packed blocks, the rank's mean loss).

        Token-exact: every micro-batch's summed token loss is divided by one normalizer, so each
        target token of the step weighs the same whichever micro-batch and rank it came in (as
        torchtitan's global_valid_tokens, transformers' num_items_in_batch). DeepSpeed divides each
        micro-batch loss by grad_accum_steps in its backward and averages the gradients over the
        data-parallel ranks, so the normalizer is the step's target count divided by both: the update
        follows the gradient of (the step's summed token loss) / (its target count). Packed blocks
        score every token; there the normalizer is the tokens of one micro-batch: the mean, as before.
        With context parallelism DeepSpeed averages over every replica (data x context ranks), each
        rank's loss covering its own tokens of the micro-batches: the normalizer divides by them all.
        """
        cfg, timer = self.run.train, self.timer
        with timer.phase("data"):
            micro_batches = [next(batches) for _ in range(cfg.grad_accum_steps)]
        if isinstance(self.model, MultitaskModel):  # {task: batch} micro-batches, normalized per task
            self.window_tokens += sum(input_tokens(b) for batch in micro_batches for b in batch.values())
            return self.model.train_step(micro_batches, 0.0)
        with timer.phase("data"):
            num_items_in_batch = self.step_targets(micro_batches) / (cfg.grad_accum_steps * self.replicas)
        self.window_tokens += sum(input_tokens(batch) for batch in micro_batches) // cfg.context_parallel_size
        return self.model.train_step(micro_batches, num_items_in_batch)

    def step_targets(self, micro_batches: Sequence) -> int:
        """Target tokens of the whole step: these micro-batches, summed over the data-parallel ranks
        (one all-reduce, before any forward pass). At least 1, so that a step whose targets are all
        masked divides zero by one. Packed blocks score every token after the first and every rank's
        blocks have one shape, so their count needs no collective (nor the wait for the slowest rank)."""
        shift = self.layout.objective not in UNSHIFTED_OBJECTIVES
        local = sum(target_tokens(batch, shift=shift) for batch in micro_batches)
        if all(scores_every_target(batch) for batch in micro_batches):
            return max(local * self.dp_size, 1)
        count = torch.tensor(local, device=self.engine.device)
        dist.all_reduce(count, group=self.topology.data_parallel_group)
        return max(int(count), 1)

    def evaluate(self) -> dict:
        """Validation loss (negative log-likelihood per target token) and perplexity over the first
        eval_samples samples, by `evaluate_perplexity` as `llmstack eval` computes them; for held-out
        pairs, retrieval recall@1 and @10 (`retrieval_recall`, as `llmstack eval --pairs`)."""
        cfg = self.run.train
        assert self.valid_data is not None  # called only when there are validation data
        if isinstance(self.valid_data, PairData):
            batches = held_out_batches(self.valid_data, cfg.eval_samples, cfg.micro_batch_size)
            return {f"val_{name}": value for name, value in self.model.evaluate(batches, 0, 0).items()}
        # Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively).
        samples = min(cfg.eval_samples, self.valid_data.num_blocks) // self.dp_size * self.dp_size
        if samples == 0:
            raise UserError(f"validation data hold fewer samples than data-parallel ranks ({self.dp_size})")
        batches = self.valid_data.eval_batches(samples, cfg.micro_batch_size, self.dp_rank, self.dp_size)
        result = self.model.evaluate(batches, samples // self.dp_size, cfg.micro_batch_size)
        return {
            "val_loss": result["loss"],
            "val_ppl": result["perplexity"],
            "val_tokens": result["tokens"],
            **{f"val_{name}": result[name] for name in ("accuracy", "span_accuracy") if name in result},
        }

    def interval_metrics(self, rank_loss: float, steps: int, start: float) -> dict[str, float]:
        """Everything logged every log_interval steps, over the `steps` steps since `start`."""
        elapsed = time.perf_counter() - start
        # Every replica's loss covers its own tokens (a context-parallel rank's share of the samples).
        loss_sum, tokens = sum_over(self.topology.replica_group, rank_loss, self.window_tokens)
        self.window_tokens = 0
        grad_norm = self.engine.get_global_grad_norm()
        phases = self.timer.pop(steps)
        return {
            "loss": loss_sum / self.replicas,
            **self.model.accuracy_metrics(),
            **self.model.task_metrics(),
            "lr": self.scheduler.get_last_lr()[0],
            **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
            **self.throughput.rates(tokens, self.global_batch_size * steps, elapsed),
            "step_time_s": elapsed / steps,
            **phases,
            **self.straggler_metrics(phases, elapsed / steps),
            "memory_gb": memory_gb(),
            "tokens_seen": self.consumed_samples * self.run.data.seq_len,
            **self.fault_counters(),
            **self.mixture_metrics(),
            **self.model.router_metrics(),
            **self.comm_metrics(),
        }

    def straggler_metrics(self, phases: dict[str, float], step_s: float) -> dict[str, float]:
        """Every rank's own time per step and data wait over the interval (llmstack.monitor.stragglers)."""
        if self.world_size == 1:
            return {}
        every = gather_over(None, own_time(phases), phases.get("time/data", 0.0))
        if self.rank != 0:  # rank 0 logs the metrics, and the warning: one line, not one per rank
            return {}
        return self.stragglers.metrics([r[0] for r in every], [r[1] for r in every], step_s)

    def comm_measured(self, step: int) -> contextlib.AbstractContextManager[Any]:
        """Count the collectives of `step` when it ends a logging interval (and they are counted)."""
        cfg = self.run.train
        if self.comm_stats is None or (step % cfg.log_interval and step != cfg.max_steps):
            return contextlib.nullcontext()
        return self.comm_stats

    def comm_metrics(self) -> dict[str, float]:
        """Bytes per collective kind of the last measured step, per rank (the mean over the
        data-parallel ranks; all-to-all volumes differ between them), as `comm/<kind>_bytes`."""
        if self.comm_stats is None:
            return {}
        counted = self.comm_stats.as_metrics()
        self.comm_stats.reset()
        means = self.sum_over_data_parallel(*counted.values())
        return {name: total / self.dp_size for name, total in zip(counted, means)}

    def mixture_metrics(self) -> dict[str, float]:
        """Each mixture source's share of the tokens trained so far (all data-parallel ranks), as
        `data_share/NAME`; a source more than 20% off its target weight is a warning that names it."""
        stream, data = self.data_stream, self.train_data
        if isinstance(data, MixedBlocks):  # every sample's source follows from its number
            tokens = data.source_samples(self.consumed_samples)
            shares = token_shares(tokens, data.expected_samples(self.consumed_samples))
        elif stream is not None:
            consumed = self.batches.state_dict() if self.batches is not None else None  # not the read-ahead
            mine = consumed["source_tokens"] if consumed is not None else dict.fromkeys(stream.names, 0)
            counts = self.sum_over_data_parallel(*(mine[name] for name in stream.names))
            shares = token_shares(dict(zip(stream.names, counts)), stream.expected_shares(self.step))
        else:
            return {}
        if self.rank == 0:
            unbalanced(shares)
        return {f"data_share/{s.source}": s.share for s in shares}

    def fault_counters(self) -> dict[str, float]:
        """Rollbacks and skipped steps: fp16 overflows (DeepSpeed's count) plus non-finite losses
        outside fp16 (the fault guard's), with the loss scale under fp16."""
        precision = loss_scale_metrics(self.engine)
        counters: dict[str, float] = dict(self.guard.counters)
        counters["skipped_steps"] += precision.pop("skipped_steps")
        return {**counters, **precision}

    def sum_over_data_parallel(self, *values: float) -> list[float]:
        return sum_over(self.topology.data_parallel_group, *values)

    @property
    def data_stream(self) -> MixtureStream | None:
        """The training data when it is a streaming mixture, whose place is saved per rank; None
        for data addressed by the consumed-sample count alone."""
        return self.train_data if isinstance(self.train_data, MixtureStream) else None

    def save_checkpoint(self) -> None:
        counters = {**self.guard.state_dict(), "tokens_seen": self.consumed_samples * self.run.data.seq_len}
        if isinstance(self.model, MultitaskModel):  # dynamic weight averaging's loss history
            counters["task_weighting"] = self.model.weighting.state_dict()
        data_state = self.batches.state_dict() if self.data_stream is not None and self.batches is not None else None
        if isinstance(self.train_data, MixedBlocks):  # the mixture in effect (the same on every rank)
            data_state = self.train_data.state_dict()
        self.checkpoints.save(self.step, self.consumed_samples, counters, data_state)

    def check_data_resumable(self, saved_dp_size: int | None) -> None:
        """A streaming mixture continues only on the data-parallel size that saved it."""
        if self.data_stream is not None and saved_dp_size is not None:
            check_data_parallel_size(saved_dp_size, self.dp_size)

    def resume(self, which: str = "auto", trust: bool = False) -> bool:
        """Continue from a checkpoint: "auto" (the newest usable one, if any) or a checkpoint path.
        `trust`: accept a checkpoint that has no llmstack manifest."""
        resumed = self.checkpoints.load(which, trust=trust, check=self.check_data_resumable)
        if resumed is not None:
            self.step, self.consumed_samples = resumed.step, resumed.consumed_samples
            self.guard.load_state_dict(resumed.counters)
            if isinstance(self.model, MultitaskModel):
                self.model.weighting.load_state_dict(resumed.counters.get("task_weighting", {}))
            if isinstance(self.train_data, (MixtureStream, MixedBlocks)) and resumed.data_state is not None:
                self.train_data.load_state_dict(resumed.data_state)
        return resumed is not None

    def roll_back(self) -> None:
        """After a loss spike: the last checkpoint's weights, optimizer and schedule, but the current
        data position, so the samples read since that checkpoint (which led to the spike) are skipped."""
        resumed = self.checkpoints.load("auto")
        if resumed is None:
            raise UserError(
                f"loss spike at step {self.step} but no checkpoint to roll back to; save earlier "
                "(train.save_interval) or turn the guard off (train.loss_spike_factor=0)"
            )
        self.guard.rolled_back(self.consumed_samples - resumed.consumed_samples)
        self.step = resumed.step
