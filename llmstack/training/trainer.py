"""The pretraining loop: a plain llmstack model trained by a DeepSpeed engine.

Read top to bottom: build (process group, tokenizer, model, engine, data), then `train()` runs
optimizer steps; each step runs `grad_accum_steps` micro-batches through the engine, which does
gradient accumulation, ZeRO partitioning, clipping, loss scaling and the LR schedule. Every
`log_interval` steps the loss (averaged over data-parallel ranks) and throughput are logged,
every `eval_interval` steps the validation loss, every `save_interval` steps a checkpoint.

Data are addressed by the number of samples consumed so far (see llmstack.data.blocks), which is
all a checkpoint needs to continue the stream exactly, on the same or another number of ranks.
"""

import functools
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from llmstack.data.blocks import PackedBlocks
from llmstack.data.stream import MixtureStream
from llmstack.data.tokenizer import load_tokenizer
from llmstack.errors import UserError
from .evaluate import evaluate_perplexity
from llmstack.monitor import MetricsLogger
from llmstack.monitor.redact import redact_secrets
from llmstack.optim.deepspeed_integration import initialize as initialize_engine
from llmstack.monitor.throughput import StepTimer, ThroughputMeter, memory_gb
from llmstack.parallel import Topology, model_parallel_seed, parallelize, to_pipeline

from .checkpoint import CheckpointManager
from .construct import build_model, full_shape
from .distributed import init_distributed
from .ds_config import complete_ds_config, load_ds_config, zero_stage
from .faults import FaultGuard
from .precision import LossScaleGuard, check_precision_supported, loss_scale_metrics
from .schedule import warmup_cosine


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_train_data(data, tokenizer):
    """Pre-tokenized packed shards (data.train) or a weighted streaming mixture of raw documents
    (data.sources); both serve `micro_batches(consumed_samples, micro, dp_rank, dp_size)`."""
    if bool(data.train) == bool(data.sources):
        raise UserError("give exactly one of data.train (packed shards) and data.sources (a mixture of raw documents)")
    if data.sources:
        for source in data.sources:
            if not isinstance(source, dict) or "paths" not in source or set(source) - {"paths", "weight", "text_field"}:
                raise UserError(f"each data.sources entry is {{paths, weight, text_field}}; got {source!r}")
        return MixtureStream(data.sources, tokenizer, data.seq_len, seed=data.seed)
    return PackedBlocks(data.train, data.seq_len, seed=data.seed)


def param_groups(model, weight_decay):
    """Weight decay on matrices and embeddings; none on norm gains and biases."""
    decay = [p for p in model.parameters() if p.requires_grad and len(full_shape(p)) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and len(full_shape(p)) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def model_inputs(batch):
    """Packed token blocks (batch, seq_len + 1) become inputs and shifted targets; fine-tuning
    batches are already the model's keyword arguments ({"input_ids", "labels"})."""
    return batch if isinstance(batch, dict) else {"input_ids": batch[:, :-1], "shift_labels": batch[:, 1:]}


def token_weighted(loss_sum, tokens, dp_group):
    """Loss and perplexity of summed token losses, added up over the data-parallel group."""
    sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
    dist.all_reduce(sums, group=dp_group)
    loss = (sums[0] / sums[1]).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(sums[1])}


def input_tokens(batch):
    """Tokens the model computes on: a packed block's inputs, or a padded fine-tuning batch."""
    return batch["input_ids"].numel() if isinstance(batch, dict) else batch[:, :-1].numel()


def pipeline_inputs(batches):
    """The pipeline engine's micro-batches: (inputs, targets) tuples of packed blocks."""
    return ((batch[:, :-1], batch[:, 1:]) for batch in batches)


class Trainer:
    def __init__(self, run, ds_config_path=None, model=None, train_data=None, valid_data=None):
        """`model`, `train_data` and `valid_data` replace what the run config would build (fine-tuning
        passes a pretrained, possibly peft-wrapped model and prompt/response data)."""
        self.run = run
        cfg = run.train
        self.rank, self.world_size = init_distributed()
        self.topology = Topology(cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
        self.dp_rank, self.dp_size = self.topology.data_parallel_rank, self.topology.data_parallel_size
        self.pipeline = cfg.pipeline_parallel_size > 1
        self.ds_config = complete_ds_config(load_ds_config(ds_config_path or cfg.ds_config), cfg, self.dp_size)
        if self.pipeline and zero_stage(self.ds_config) > 1:
            raise UserError(
                f"DeepSpeed's pipeline engine works with ZeRO stage 0 or 1, not {zero_stage(self.ds_config)}: "
                "use ds_configs/zero1.json with train.pipeline_parallel_size > 1"
            )
        check_precision_supported(self.ds_config)

        self.tokenizer = load_tokenizer(run.data.tokenizer or run.model["init_from"])
        if train_data is None:
            train_data = build_train_data(run.data, self.tokenizer)
        if valid_data is None and run.data.valid:
            valid_data = PackedBlocks(run.data.valid, run.data.seq_len, shuffle=False)
        self.train_data, self.valid_data = train_data, valid_data

        seed_everything(cfg.seed)
        # Same seed, same weights, whichever way the layout builds it (see .construct).
        if model is None:
            model = build_model(run.model, self.tokenizer, run.data.seq_len, self.ds_config, self.topology)
        self.model_config = model.config
        model = self.apply_parallelism(model)
        model_parallel_seed(cfg.seed, self.topology)  # dropout streams per tensor-parallel rank
        # llmstack's own optimizers (1-bit Adam) are built by llmstack; DeepSpeed builds the others.
        self.engine, _, _, self.scheduler = initialize_engine(
            model,
            self.ds_config,
            param_groups(model, cfg.weight_decay),
            mpu=None if self.pipeline else self.topology,
            pipeline_stages=cfg.pipeline_parallel_size,
            lr_scheduler=functools.partial(
                warmup_cosine, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps
            ),
        )
        self.loss_scale_guard = LossScaleGuard(self.engine, patience=cfg.max_nonfinite_steps)

        self.step = 0
        self.consumed_samples = 0
        self.window_tokens = 0  # tokens this rank computed on since the last log
        self.checkpoints = CheckpointManager(
            os.path.join(cfg.out_dir, "checkpoints"), self.engine, cfg, redact_secrets(run.to_dict()),
            model_files=(self.model_config, self.tokenizer),
        )
        self.guard = FaultGuard(cfg, fp16=self.train_dtype == torch.float16, device=self.engine.device)
        self.stopped_by = None  # the signal that ended training early (after a checkpoint), if any
        self.throughput = ThroughputMeter.from_config(
            run.monitor, self.model_config, run.data.seq_len, self.world_size, dtype=self.train_dtype
        )
        self.timer = StepTimer()
        self.metrics = MetricsLogger.from_config(
            run.monitor, cfg.out_dir, run_config=run.to_dict(), enabled=self.rank == 0, total_steps=cfg.max_steps
        )

    def apply_parallelism(self, model):
        """Tensor parallelism rewrites the model in place; pipeline parallelism wraps it in a
        DeepSpeed PipelineModule (which applies tensor parallelism itself)."""
        cfg = self.run.train
        if self.pipeline:
            interval = 1 if cfg.activation_checkpointing else 0
            return to_pipeline(model, self.topology, activation_checkpoint_interval=interval)
        if cfg.tensor_parallel_size > 1:
            try:
                parallelize(model, self.topology)
            except ValueError as e:
                raise UserError(str(e)) from None
        if cfg.activation_checkpointing:
            model.activation_checkpointing_enable()
        return model

    @property
    def train_dtype(self):
        if self.ds_config.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if self.ds_config.get("fp16", {}).get("enabled"):
            return torch.float16
        return torch.float32

    @property
    def global_batch_size(self):
        return self.run.train.micro_batch_size * self.run.train.grad_accum_steps * self.dp_size

    def train(self):
        cfg = self.run.train
        batches = self.train_batches()
        if self.valid_data is not None and self.step == 0:
            self.metrics.log(0, self.evaluate())
        self.engine.train()
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        with self.guard:  # SIGTERM/SIGINT: save after the current step, then stop
            while self.step < cfg.max_steps:
                loss = self.train_step(batches)
                self.step += 1
                self.consumed_samples += self.global_batch_size
                # All ranks agree on skipped steps, spikes, saves and signals.
                verdict = self.guard.after_step(
                    self.step, loss, self.engine.was_step_applied(), self.checkpoints.due(self.step)
                )
                if verdict.rollback:
                    self.roll_back()
                    batches = self.train_batches()
                    continue
                window_loss, window_steps = window_loss + loss, window_steps + 1

                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    self.metrics.log(self.step, self.interval_metrics(window_loss / window_steps, window_steps, window_start))
                    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
                if self.valid_data is not None and (self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps):
                    self.metrics.log(self.step, self.evaluate())
                if verdict.save or self.step == cfg.max_steps:
                    self.save_checkpoint()
                if verdict.stop_signal:
                    self.stopped_by = verdict.stop_signal
                    break
        self.checkpoints.wait()
        self.metrics.close()

    def train_batches(self):
        cfg = self.run.train
        return self.train_data.micro_batches(self.consumed_samples, cfg.micro_batch_size, self.dp_rank, self.dp_size)

    def train_step(self, batches):
        """One optimizer step over grad_accum_steps micro-batches; returns this rank's mean loss."""
        if self.pipeline:  # the pipeline engine runs the micro-batches through its 1F1B schedule
            with self.timer.phase("pipeline"):
                loss = self.engine.train_batch(pipeline_inputs(batches)).item()
            self.loss_scale_guard.after_step()
            self.window_tokens += self.run.train.micro_batch_size * self.run.train.grad_accum_steps * self.run.data.seq_len
            return loss
        total, timer = 0.0, self.timer
        for _ in range(self.run.train.grad_accum_steps):
            with timer.phase("data"):
                batch = next(batches)
            with timer.phase("forward"):
                loss = self.engine(**model_inputs(batch)).loss
            with timer.phase("backward"):
                self.engine.backward(loss)
            with timer.phase("optimizer"):
                self.engine.step()
                self.loss_scale_guard.after_step()
            total += loss.item()
            self.window_tokens += input_tokens(batch)
        return total / self.run.train.grad_accum_steps

    def evaluate(self):
        """Token-weighted validation loss and perplexity over the first eval_samples samples."""
        cfg = self.run.train
        # Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively).
        samples = min(cfg.eval_samples, self.valid_data.num_blocks) // self.dp_size * self.dp_size
        if samples == 0:
            raise UserError(f"validation data hold fewer samples than data-parallel ranks ({self.dp_size})")
        batches = self.valid_data.eval_batches(samples, cfg.micro_batch_size, self.dp_rank, self.dp_size)
        dp_group = self.topology.data_parallel_group
        if self.pipeline:
            result = self.evaluate_pipeline(batches, samples // self.dp_size, dp_group)
        elif self.run.train.tensor_parallel_size > 1:
            result = self.evaluate_tensor_parallel(batches, dp_group)
        else:
            result = evaluate_perplexity(self.engine, batches, dp_group=dp_group)
        return {"val_loss": result["loss"], "val_ppl": result["perplexity"], "val_tokens": result["tokens"]}

    def evaluate_pipeline(self, batches, rank_samples, dp_group):
        """Validation through the pipeline engine: eval_batch runs grad_accum_steps micro-batches
        of equal-length blocks and returns their mean loss."""
        cfg = self.run.train
        calls = rank_samples // (cfg.micro_batch_size * cfg.grad_accum_steps)
        if calls == 0:
            raise UserError("train.eval_samples is smaller than one pipeline batch (micro x accumulation x data-parallel)")
        inputs = pipeline_inputs(batches)
        tokens_per_call = cfg.micro_batch_size * cfg.grad_accum_steps * self.run.data.seq_len
        loss_sum = sum(self.engine.eval_batch(inputs).item() for _ in range(calls)) * tokens_per_call
        return token_weighted(loss_sum, calls * tokens_per_call, dp_group)

    @torch.no_grad()
    def evaluate_tensor_parallel(self, batches, dp_group):
        """Validation with vocabulary-split logits: the model's own vocab-parallel loss per block."""
        self.engine.eval()
        loss_sum = tokens = 0
        for batch in batches:
            n = batch[:, 1:].numel()
            loss_sum += self.engine(**model_inputs(batch)).loss.item() * n
            tokens += n
        self.engine.train()
        return token_weighted(loss_sum, tokens, dp_group)

    def interval_metrics(self, rank_loss, steps, start):
        """Everything logged every log_interval steps, over the `steps` steps since `start`."""
        elapsed = time.perf_counter() - start
        loss_sum, tokens = self.sum_over_data_parallel(rank_loss, self.window_tokens)
        self.window_tokens = 0
        grad_norm = self.engine.get_global_grad_norm()
        return {
            "loss": loss_sum / self.dp_size,
            "lr": self.scheduler.get_last_lr()[0],
            **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
            **self.throughput.rates(tokens, self.global_batch_size * steps, elapsed),
            "step_time_s": elapsed / steps,
            **self.timer.pop(steps),
            "memory_gb": memory_gb(),
            "tokens_seen": self.consumed_samples * self.run.data.seq_len,
            **self.fault_counters(),
        }

    def fault_counters(self):
        """Rollbacks and skipped steps: fp16 overflows (DeepSpeed's count) plus non-finite losses
        outside fp16 (the fault guard's), with the loss scale under fp16."""
        precision = loss_scale_metrics(self.engine)
        counters = dict(self.guard.counters)
        counters["skipped_steps"] += precision.pop("skipped_steps")
        return {**counters, **precision}

    def sum_over_data_parallel(self, *values):
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.topology.data_parallel_group)
        return t.tolist()

    def save_checkpoint(self):
        counters = {**self.guard.state_dict(), "tokens_seen": self.consumed_samples * self.run.data.seq_len}
        self.checkpoints.save(self.step, self.consumed_samples, counters)

    def resume(self, which="auto", trust=False):
        """Continue from a checkpoint: "auto" (the newest usable one, if any) or a checkpoint path.
        `trust`: accept a checkpoint that has no llmstack manifest."""
        resumed = self.checkpoints.load(which, trust=trust)
        if resumed is not None:
            self.step, self.consumed_samples = resumed.step, resumed.consumed_samples
            self.guard.load_state_dict(resumed.counters)
        return resumed is not None

    def roll_back(self):
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
