"""Multi-task training (train.objective: multitask): several tasks, each with its data and head,
sharing one trunk (llmstack.models.multitask), their losses weighted by one of WEIGHTINGS.

Sampling: every micro-batch holds micro_batch_size samples of every task (sample i of each
task's own seeded order), and one forward pass computes every task's loss on its batch; the
total is their weighted sum, with one backward pass. A task's loss divides its summed loss by the
step's scored targets of that task over every rank and micro-batch (as the trainer's
num_items_in_batch), so that 2 ranks train as one process.

Weightings (each task's `weight` multiplies what the method gives):
    fixed        the tasks' weights
    uncertainty  learned log-variances s_i: exp(-s_i) L_i + s_i / 2 (Kendall, Gal and Cipolla 2018);
                 the s_i are model parameters, trained and checkpointed with the model
    dwa          dynamic weight averaging (Liu, Johns and Davison 2019): w_i = K softmax_i(r_i / T),
                 r_i = L_i(t-1) / L_i(t-2), the ratio of the task's last two step losses (means over
                 every rank), K tasks, temperature T (train.dwa_temperature); 1 for the first two steps.
                 It needs no extra backward pass (GradNorm needs each task's gradient norm at a shared
                 layer: one backward pass a task). Its loss history is checkpointed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from llmstack.data.blocks import SampleSchedule
from llmstack.data.labelled import LabelledData
from llmstack.models.loss import count_targets

from .train_model import Batch, EngineModel, model_inputs, sum_over

WEIGHTINGS = ("fixed", "uncertainty", "dwa")


class TaskWeighting:
    """Each task's weight for the next step: fixed, or by dynamic weight averaging (module docstring)."""

    def __init__(self, method: str, weights: Sequence[float], temperature: float = 2.0) -> None:
        self.method, self.base, self.temperature = method, [float(w) for w in weights], temperature
        self.history: list[list[float]] = []  # the last two steps' task losses (dwa)

    def weights(self) -> list[float]:
        if self.method != "dwa" or len(self.history) < 2:
            return list(self.base)
        ratios = [now / max(before, 1e-12) for before, now in zip(*self.history)]
        top = max(r / self.temperature for r in ratios)
        exps = [math.exp(r / self.temperature - top) for r in ratios]
        return [w * len(exps) * e / sum(exps) for w, e in zip(self.base, exps)]

    def update(self, task_losses: Sequence[float]) -> None:
        """After a step: its task losses (the same on every rank)."""
        if self.method == "dwa":
            self.history = [*self.history, list(task_losses)][-2:]

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = [list(losses) for losses in state.get("history", [])]


class MultitaskData:
    """Each task's samples; a micro-batch is {task name: that task's batch} (module docstring)."""

    def __init__(self, tasks: Mapping[str, SampleSchedule]) -> None:
        self.tasks = dict(tasks)

    def micro_batches(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> Iterator[Any]:
        streams = {
            name: data.micro_batches(consumed_samples, micro_batch_size, dp_rank, dp_size)
            for name, data in self.tasks.items()
        }
        while True:
            yield {name: next(stream) for name, stream in streams.items()}


def build_multitask_data(
    tasks: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    seed: int,
    blocks: Any,
) -> MultitaskData:
    """The tasks' data: `blocks(prefixes, objective, seed)` for a language model's packed shards
    (the trainer's packed_blocks), LabelledData for a classifier's JSONL; each task its own seed."""
    data: dict[str, SampleSchedule] = {}
    for i, task in enumerate(tasks):
        kind, task_seed = task["kind"], seed + 1000 * i
        if kind in ("causal_lm", "mlm"):
            data[task["name"]] = blocks(task["data"], "mlm" if kind == "mlm" else "causal", task_seed)
        else:
            data[task["name"]] = LabelledData(
                task["data"], kind, int(task["num_labels"]), tokenizer, seq_len, task_seed
            )
    return MultitaskData(data)


def task_inputs(batch: Mapping[str, Batch]) -> dict[str, dict[str, torch.Tensor]]:
    """Every task's batch as the model's keyword arguments (packed blocks become inputs and shifted targets)."""
    return {name: model_inputs(task_batch) for name, task_batch in batch.items()}


def scored_targets(inputs: Mapping[str, torch.Tensor]) -> int:
    """Targets a task's batch scores: its (shifted) labels that are not ignored."""
    return int(count_targets(inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"]))


@dataclasses.dataclass
class MultitaskModel(EngineModel):
    """DeepSpeed's engine over a multi-task model: every task's loss in one forward pass."""

    task_names: Sequence[str] = ()
    weighting: TaskWeighting = dataclasses.field(default_factory=lambda: TaskWeighting("fixed", []))
    window: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # since the last log

    def train_step(self, micro_batches: Sequence[Batch], num_items_in_batch: float) -> float:
        """One optimizer step; returns this rank's weighted loss (mean over its micro-batches).
        `num_items_in_batch` is unused: each task has its own normalizer, the step's targets of
        that task over every rank and micro-batch."""
        batches = [task_inputs(batch) for batch in micro_batches]  # type: ignore[arg-type]  # {task: batch}
        local = [sum(scored_targets(b[name]) for b in batches) for name in self.task_names]
        counts = sum_over(self.topology.data_parallel_group, *local)
        normalizers = [max(c, 1.0) / (len(batches) * self.topology.data_parallel_size) for c in counts]
        weights = self.weighting.weights()
        n = len(self.task_names)
        total = torch.zeros((), dtype=torch.float64)
        sums = torch.zeros(4, n, dtype=torch.float64)  # task losses, correct, scored, effective weights
        for batch in batches:
            with self.timer.phase("forward"):
                output = self.engine(tasks=batch, task_weights=weights, num_items=normalizers)
            with self.timer.phase("backward"):
                self.engine.backward(output.loss)
            with self.timer.phase("optimizer"):
                self.engine.step()
                self.loss_scale_guard.after_step()
            total += output.loss.detach().double().cpu()
            parts = (output.task_losses, output.task_correct, output.task_scored, output.task_weights)
            sums += torch.stack([p.detach().double().cpu() for p in parts])
        task_losses = [
            x / self.topology.data_parallel_size
            for x in sum_over(self.topology.data_parallel_group, *(sums[0] / len(batches)).tolist())
        ]
        self.weighting.update(task_losses)
        self.add_to_window(task_losses, sums[1].tolist(), sums[2].tolist(), (sums[3] / len(batches)).tolist())
        return total.item() / len(batches)

    def add_to_window(
        self, losses: Sequence[float], correct: Sequence[float], scored: Sequence[float], weights: Sequence[float]
    ) -> None:
        for i, name in enumerate(self.task_names):
            loss, right, count, weight, steps = self.window.get(name, [0.0] * 5)
            self.window[name] = [loss + losses[i], right + correct[i], count + scored[i], weights[i], steps + 1]

    def task_metrics(self) -> dict[str, float]:
        """Per task since the last call: `task/NAME/loss` (mean over the steps and every rank),
        `task/NAME/weight` (the last step's) and `task/NAME/accuracy` (over every rank's scored
        targets: next tokens, masked tokens, texts or labelled words)."""
        if not self.window:
            return {}
        names = list(self.window)
        counts = sum_over(self.topology.data_parallel_group, *(v for n in names for v in self.window[n][1:3]))
        metrics: dict[str, float] = {}
        for i, name in enumerate(names):
            loss, _, _, weight, steps = self.window[name]
            right, scored = counts[2 * i], counts[2 * i + 1]
            metrics |= {f"task/{name}/loss": loss / steps, f"task/{name}/weight": weight}
            if scored:
                metrics[f"task/{name}/accuracy"] = right / scored
        self.window = {}
        return metrics

    def accuracy_metrics(self) -> dict[str, float]:
        """None across tasks: each task's accuracy is in task_metrics."""
        return {}
