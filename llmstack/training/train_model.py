"""The model a run trains, as the trainer sees it: a plain llmstack model with its layout applied,
under its DeepSpeed engine.

`apply_layout` applies a layout from outside the model (tensor and sequence parallelism by
llmstack.parallel's plans, expert parallelism, a pipeline's cut into stages, activation
checkpointing, compilation), `build_engine` builds DeepSpeed's engine over the result, and
`train_model_for` wraps that engine in the one interface the trainer uses, whatever the layout:

    train_step(micro_batches, num_items_in_batch)   one optimizer step; this rank's loss
    evaluate(batches, samples_per_rank, micro)       NLL per token, perplexity, accuracy and scored
                                                     tokens, as `llmstack eval`
    accuracy_metrics()                               training accuracy since the last call
    task_metrics()                                   a multi-task run's per-task loss, weight, accuracy
    router_metrics()                                 an MoE model's routing since the last call
    full_state_dict()                                the whole model's weights on global rank 0, as
                                                     one process holds them (every rank calls it)
    describe()                                       the layout, for the log

`EngineModel` runs DeepSpeed's engine one micro-batch at a time (data, tensor, sequence and expert
parallelism, ZeRO 0-3); `PipelineModel` hands a step's micro-batches to the pipeline engine's
1F1B schedule. The differences between layouts live here, not in the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from llmstack.compat.deepspeed import check_moe_engine
from llmstack.compat.transformers import enable_activation_checkpointing
from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.loss import (
    PredictionTally,
    count_targets,
    next_token_targets,
    split_block,
    tallying_predictions,
)
from llmstack.models.moe import RouterStatsWindow
from llmstack.monitor.throughput import StepTimer
from llmstack.optim.deepspeed_integration import initialize as initialize_engine
from llmstack.parallel import (
    Topology,
    gather_full_state_dict,
    parallelize,
    to_pipeline,
    vocab_parallel_cross_entropy,
)
from llmstack.parallel.context_parallel import context_parallelize, shard_sequence
from llmstack.parallel.expert_parallel import expert_parallelize, moe_blocks
from llmstack.parallel.layout import Layout

from .compile import compile_decoder_layers
from .evaluate import BatchNLL, evaluate_perplexity, masked_lm_nll, model_nll, span_corruption_nll
from .expert_parallel import engine_with_experts, named_param_groups
from .precision import LossScaleGuard
from .tiled_mlp import tile_mlps

Batch = torch.Tensor | dict[str, torch.Tensor]
# Objectives whose labels are the targets as they stand (not the next tokens of the inputs).
UNSHIFTED_OBJECTIVES = ("mlm", "span_corruption")


def apply_layout(model: nn.Module, layout: Layout, topology: Topology) -> nn.Module:
    """`model` as `layout` trains it. Tensor and sequence parallelism split it in place; a pipeline
    wraps it in a DeepSpeed PipelineModule (which applies tensor parallelism itself); expert
    parallelism then keeps this rank's experts (of this stage's MoE layers, in a pipeline), and
    context parallelism replaces each attention by its split one, and train.tiled_mlp_tokens tiles
    the MLPs; then, in every layout, the layout's compile setting (train.compile, `auto` resolved) compiles the
    decoder blocks."""
    plain = cast(LLMStackForCausalLM, model)  # model-parallel layouts take a plain llmstack model
    if layout.pipeline > 1:
        model = to_pipeline(plain, topology, activation_checkpoint_interval=int(layout.activation_checkpointing))
    elif layout.tensor > 1:
        try:
            parallelize(plain, topology, sequence_parallel=layout.sequence_parallel)
        except ValueError as e:
            raise UserError(str(e)) from None
    if topology.expert_parallel_group is not None:  # a pipeline stage's MoE blocks, or all of them
        expert_parallelize(model, topology.expert_parallel_group)
    if layout.context > 1:
        context_parallelize(model, topology.context_parallel_group, layout.context_method)
    if layout.tiled_mlp_tokens:
        tile_mlps(model, layout.tiled_mlp_tokens)
    if layout.activation_checkpointing and layout.pipeline == 1:
        enable_activation_checkpointing(cast(PreTrainedModel, model))  # a peft model forwards the calls
    if layout.compile:
        compile_decoder_layers(model)
    return model


def build_engine(
    model: nn.Module,
    layout: Layout,
    topology: Topology,
    ds_config: dict[str, Any],
    param_groups: list[dict[str, Any]],
    lr_schedule: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """DeepSpeed's engine (a pipeline engine for a pipeline's stages) over `apply_layout`'s model,
    and its learning-rate scheduler. llmstack's own optimizers (1-bit Adam) are built by llmstack;
    DeepSpeed builds the others."""
    pipeline = layout.pipeline > 1
    with engine_with_experts(topology, layout.zero_stage):
        engine, _, _, scheduler = initialize_engine(
            model,
            ds_config,
            named_param_groups(param_groups, topology),
            mpu=None if pipeline else topology,  # a pipeline engine takes its grid from the PipelineModule
            pipeline_stages=layout.pipeline,
            lr_scheduler=lr_schedule,
        )
    if topology.expert_parallel_size > 1 and moe_blocks(model):  # a pipeline stage may hold none
        check_moe_engine(engine, topology.expert_data_parallel_group)
    return engine, scheduler


def model_inputs(batch: Batch) -> dict:
    """Packed token blocks (batch, seq_len + 1) become inputs and shifted targets; fine-tuning,
    masked-LM and document-masked batches are already the model's keyword arguments ({"input_ids",
    "labels"} or "shift_labels", with a document-masked batch's "position_ids" and "document_ids")."""
    if isinstance(batch, dict):
        return batch
    input_ids, targets = split_block(batch)
    return {"input_ids": input_ids, "shift_labels": targets}


def target_tokens(batch: Batch, shift: bool = True) -> int:
    """Targets a micro-batch scores: every token after the first of a packed block, the labels
    that are not -100 (after the shift; none for a masked LM's) of a fine-tuning or masked batch."""
    if isinstance(batch, dict) and "shift_labels" in batch:  # a document-masked packed batch
        return int(count_targets(batch["shift_labels"]))
    if isinstance(batch, dict) and "labels" not in batch:  # a contrastive batch: its queries (llmstack.data.pairs)
        return batch["input_ids"].shape[0] // 2
    if isinstance(batch, dict):
        targets = next_token_targets(labels=batch["labels"]) if shift else batch["labels"]
        assert targets is not None  # labels were given
        return int(count_targets(targets))
    return split_block(batch)[1].numel()


def scores_every_target(batch: Batch) -> bool:
    """Whether a micro-batch is packed blocks, scoring every token after the first (with or
    without their documents), or contrastive pairs: its target count follows from its shape."""
    return isinstance(batch, torch.Tensor) or "shift_labels" in batch or "labels" not in batch


def input_tokens(batch: Batch) -> int:
    """Tokens the model computes on: a packed block's inputs, or a padded fine-tuning batch."""
    return batch["input_ids"].numel() if isinstance(batch, dict) else batch[:, :-1].numel()


def pipeline_inputs(batches: Iterable[Batch], num_items_in_batch: float | None = None) -> Iterator[tuple]:
    """The pipeline engine's micro-batches: (inputs, labels) tuples of packed blocks (labels: the
    next tokens) or of a masked LM's batches (labels aligned with the inputs); the labels carry the
    loss normalizer when one is given (see LLMStackPipeline.loss)."""
    for batch in batches:
        input_ids, targets = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else split_block(batch)
        yield input_ids, targets if num_items_in_batch is None else (targets, torch.tensor(num_items_in_batch))


def in_groups(items: Iterable, n: int) -> Iterator[tuple]:
    """Consecutive tuples of n items (a shorter last group is dropped)."""
    iterator = iter(items)
    return zip(*[iterator] * n)


def sum_over(group: dist.ProcessGroup | None, *values: float) -> list[float]:
    """Each of `values` summed over the ranks of `group`, in float64."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, group=group)
    return t.tolist()


def gather_over(group: dist.ProcessGroup | None, *values: float) -> list[list[float]]:
    """`values` of every rank of `group`, in group-rank order, in float64."""
    mine = torch.tensor(values, dtype=torch.float64, device=collective_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [t.tolist() for t in every]


def collective_device() -> torch.device:
    """Where a collective's tensors must be: NCCL's are on this rank's GPU, gloo's on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclasses.dataclass
class EngineModel:
    """DeepSpeed's engine over the model, run one micro-batch at a time."""

    engine: Any  # deepspeed.DeepSpeedEngine
    layout: Layout
    topology: Topology
    config: LLMStackConfig
    grad_accum_steps: int
    timer: StepTimer
    loss_scale_guard: LossScaleGuard
    router_window: RouterStatsWindow | None = None
    predictions: PredictionTally = dataclasses.field(default_factory=PredictionTally)  # since the last log

    def describe(self) -> str:
        return self.layout.describe()

    @property
    def masked_lm(self) -> bool:
        return self.layout.objective == "mlm"

    def train_step(self, micro_batches: Sequence[Batch], num_items_in_batch: float) -> float:
        """One optimizer step over the micro-batches, each summed token loss divided by
        `num_items_in_batch`. Returns this rank's loss, the mean over its micro-batches."""
        # Read once per step, not once per micro-batch; summed in float64 so that the logged loss
        # does not depend on how the step is split into micro-batches (1 rank x 2 = 2 ranks x 1).
        total = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        for batch in micro_batches:
            with self.timer.phase("forward"), self.tallying():
                output = self.engine(**self.inputs(batch), num_items_in_batch=num_items_in_batch)
                loss = output.loss
            if self.router_window is not None:
                self.router_window.add(output.router_stats)
            with self.timer.phase("backward"):
                self.engine.backward(loss)
            with self.timer.phase("optimizer"):
                self.engine.step()
                self.loss_scale_guard.after_step()
            total += loss.detach().double()
        return total.item() / len(micro_batches)

    def inputs(self, batch: Batch) -> dict:
        """The model's keyword arguments for a micro-batch: with context parallelism, this rank's
        tokens of it (the batch is the whole sample on every rank of the context-parallel group)."""
        if self.layout.context == 1:
            return model_inputs(batch)
        return shard_sequence(model_inputs(batch), self.topology.context_parallel_group)

    def tallying(self) -> contextlib.AbstractContextManager[PredictionTally]:
        """Count the targets that the training losses computed inside predict (see accuracy_metrics)."""
        return tallying_predictions(self.predictions)

    def accuracy_metrics(self) -> dict[str, float]:
        """Training accuracy since the last call: the scored targets of every replica's micro-batches
        whose most likely token was the target (next-token, or masked-token for a masked LM)."""
        correct, scored = sum_over(self.topology.replica_group, *self.predicted_counts())
        name = "span_accuracy" if self.layout.objective == "span_corruption" else "accuracy"  # spans counted
        return {name: correct / scored} if scored else {}

    def task_metrics(self) -> dict[str, float]:
        """Per-task metrics since the last call: none but a multi-task run's (llmstack.training.multitask)."""
        return {}

    def predicted_counts(self) -> tuple[int, int]:
        """(correct, scored) of this rank's training losses since the last call."""
        counts, self.predictions = self.predictions.counts(), PredictionTally()
        return counts

    def evaluate(self, batches: Iterable[Batch], samples_per_rank: int, micro_batch_size: int) -> dict[str, float]:
        """NLL per target token, perplexity, accuracy and scored tokens over every data-parallel rank's
        `batches`: `evaluate_perplexity`, with this layout's batch NLL."""
        batch_nll = self.batch_nll()
        if self.layout.context > 1:  # each rank scores its own tokens; the sums add up over the replicas
            whole_nll = batch_nll
            batch_nll = lambda engine, batch: whole_nll(engine, self.inputs(batch))  # noqa: E731
        return evaluate_perplexity(self.engine, batches, dp_group=self.topology.replica_group, batch_nll=batch_nll)

    def batch_nll(self) -> BatchNLL:
        """The evaluation of one batch, where a tensor-parallel model's logits are a vocabulary slice."""
        if self.layout.objective == "span_corruption":
            return span_corruption_nll
        scored_nll = masked_lm_nll if self.masked_lm else model_nll
        if self.layout.tensor == 1:
            return scored_nll
        token_loss = functools.partial(
            vocab_parallel_cross_entropy, group=self.topology.tensor_parallel_group, vocab_size=self.config.vocab_size
        )
        return functools.partial(scored_nll, token_loss=token_loss)

    def router_metrics(self) -> dict[str, float]:
        """Expert load, imbalance, dropped tokens and auxiliary losses of an MoE model since the
        last call, over every data-parallel rank (see RouterStatsWindow); none for a dense model."""
        totals = self.router_totals()
        if self.router_window is None or totals is None:
            return {}
        return self.router_window.metrics(sum_over(self.topology.data_parallel_group, *totals))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict under the plain model's names (CPU tensors) on global rank 0,
        None elsewhere: tensor, pipeline and expert shards merged, ZeRO-3 partitions gathered.
        Collective over every rank. (Export reads the same weights from a checkpoint instead.)"""
        return gather_full_state_dict(self.engine.module, self.topology)

    def router_totals(self) -> list[float] | None:
        """This rank's routing sums since the last call (None for a dense model)."""
        return None if self.router_window is None else self.router_window.totals()


@dataclasses.dataclass
class PipelineModel(EngineModel):
    """DeepSpeed's pipeline engine: a step's micro-batches go through its 1F1B schedule together,
    and each stage holds its own MoE layers' routing statistics."""

    def train_step(self, micro_batches: Sequence[Batch], num_items_in_batch: float) -> float:
        with self.timer.phase("pipeline"), self.tallying():  # the last stage computes the losses
            loss = self.engine.train_batch(pipeline_inputs(micro_batches, num_items_in_batch)).item()
        if self.router_window is not None:  # this stage's MoE layers, in the step's last micro-batch
            layers, stats = self.engine.module.router_stats()
            self.router_window.add(stats, layers)
        self.loss_scale_guard.after_step()
        return loss

    def evaluate(self, batches: Iterable[Batch], samples_per_rank: int, micro_batch_size: int) -> dict[str, float]:
        """eval_batch takes grad_accum_steps micro-batches at a time (see pipeline_nll)."""
        max_batches = samples_per_rank // (micro_batch_size * self.grad_accum_steps)
        if max_batches == 0:
            raise UserError(
                "train.eval_samples is smaller than one pipeline batch (micro x accumulation x data-parallel)"
            )
        return evaluate_perplexity(
            self.engine,
            in_groups(batches, self.grad_accum_steps),
            max_batches=max_batches,
            dp_group=self.topology.data_parallel_group,
            batch_nll=self.pipeline_nll,
        )

    def pipeline_nll(
        self, engine: Any, micro_batches: Sequence[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed NLL, scored and correctly predicted targets of grad_accum_steps micro-batches through
        the pipeline engine. With a normalizer of 1 each micro-batch's loss is its summed NLL; eval_batch
        returns their mean over the micro-batches and the data-parallel ranks, so this rank's share of the
        total is that mean times the micro-batches (evaluate_perplexity adds the shares over the ranks).
        The last stage counts the correct predictions: summed over the stages, every stage has them."""
        with tallying_predictions() as tally:
            # Shaped [1] on the stages before the last.
            mean = engine.eval_batch(pipeline_inputs(micro_batches, num_items_in_batch=1.0)).reshape(())
        # A pipeline's dict batches are a masked LM's, whose labels are not shifted.
        targets = sum(target_tokens(batch, shift=not isinstance(batch, dict)) for batch in micro_batches)
        (correct,) = sum_over(self.topology.pipeline_parallel_group, tally.counts()[0])
        return mean * len(micro_batches), torch.tensor(targets), torch.tensor(correct)

    def predicted_counts(self) -> tuple[int, int]:
        """The last stage's counts, on every stage."""
        correct, scored = sum_over(self.topology.pipeline_parallel_group, *super().predicted_counts())
        return int(correct), int(scored)

    def router_totals(self) -> list[float] | None:
        """Each stage holds its own layers' statistics, over the same passes: summed over the stages."""
        totals = super().router_totals()
        if totals is None:
            return None
        *sums, passes = totals
        return [*sum_over(self.topology.pipeline_parallel_group, *sums), passes]


def train_model_for(layout: Layout, **parts: Any) -> EngineModel:
    """The train-model interface of an engine built over `apply_layout`'s model (see EngineModel's
    fields; a contrastive run's also ContrastiveModel's, a multi-task run's MultitaskModel's)."""
    if layout.objective == "contrastive":
        from .contrastive import ContrastiveModel  # which builds on EngineModel

        return ContrastiveModel(layout=layout, **parts)
    if layout.objective == "multitask":
        from .multitask import MultitaskModel  # which builds on EngineModel

        return MultitaskModel(layout=layout, **parts)
    return PipelineModel(layout=layout, **parts) if layout.pipeline > 1 else EngineModel(layout=layout, **parts)
