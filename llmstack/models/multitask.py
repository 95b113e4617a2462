"""One llmstack trunk shared by several task heads (multi-task training).

A task is a causal LM, a masked LM, a sequence classification or a token classification
(TASK_KINDS). The trunk is the decoder's (causal attention) or, when a task is a masked LM, the
encoder's (bidirectional). The language-model tasks share the vocabulary head (`lm_head`, tied
to the embeddings by default); each classification task has a head of its own in `heads[name]`:

    sequence classification, decoder   `score`, bias-free, on the last token that is not padding
                                        (LlamaForSequenceClassification's head and pooling)
    sequence classification, encoder   `dense`, GELU, `classifier`, on the first token
                                        (EuroBertForSequenceClassification, classifier_pooling "bos")
    token classification               `classifier` on every token

so that a sequence-classification head with the trunk has the stock class's parameter names
(`classification_state_dict`). One forward pass computes every task's loss on its own batch and
their weighted sum. `learn_task_variance` adds one learned log-variance s_i a task: the task's
loss L_i then counts as exp(-s_i) L_i + s_i / 2 (Kendall, Gal and Cipolla 2018, the form of their
classification likelihood), so a noisier task weighs less and s_i cannot grow without cost.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .configuration_llmstack import LLMStackConfig
from .embedding import pool
from .loss import IGNORE_INDEX, next_token_targets, tallying_predictions
from .modeling_llmstack import LLMStackModel, LLMStackPreTrainedModel

TASK_KINDS = ("causal_lm", "mlm", "sequence_classification", "token_classification")
LM_KINDS = ("causal_lm", "mlm")
CLASSIFICATION_KINDS = ("sequence_classification", "token_classification")


class LLMStackMultitaskConfig(LLMStackConfig):
    """LLMStackConfig of a multi-task model.

    tasks: [{"name", "kind", "num_labels"}] in training order (num_labels for classification kinds)
    learn_task_variance: each task's loss weighted by a learned log-variance (module docstring)
    mask_token_id: the masked-LM task's mask token (the trunk is then bidirectional)
    """

    model_type = "llmstack_multitask"

    def __init__(
        self,
        tasks: Sequence[Mapping[str, Any]] = (),
        learn_task_variance: bool = False,
        mask_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.tasks = [dict(t) for t in tasks]
        kinds = [t.get("kind") for t in self.tasks]
        if any(k not in TASK_KINDS for k in kinds):
            raise ValueError(f"task kinds must be among {', '.join(TASK_KINDS)}; got {kinds}")
        if "causal_lm" in kinds and "mlm" in kinds:
            raise ValueError("a causal LM task needs a causal trunk and a masked LM task a bidirectional one")
        if any(k in CLASSIFICATION_KINDS and int(t.get("num_labels") or 0) < 2 for k, t in zip(kinds, self.tasks)):
            raise ValueError("every classification task needs num_labels of at least 2")
        if kwargs.get("num_local_experts"):
            raise ValueError("mixture of experts is not wired into the multi-task model; its MLPs are dense")
        self.learn_task_variance = learn_task_variance
        self.mask_token_id = mask_token_id
        self.causal = "mlm" not in kinds
        super().__init__(**kwargs)

    @property
    def task_names(self) -> list[str]:
        return [t["name"] for t in self.tasks]


class SequenceClassificationHead(nn.Module):
    """A text's class logits from the trunk's hidden states, as the stock class of its trunk (module docstring)."""

    def __init__(self, config: LLMStackMultitaskConfig, num_labels: int) -> None:
        super().__init__()
        self.causal = config.causal
        if self.causal:
            self.score = nn.Linear(config.hidden_size, num_labels, bias=False)
        else:
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.activation = nn.GELU()
            self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.causal:
            return self.score(pool(hidden, attention_mask, "last"))
        return self.classifier(self.activation(self.dense(hidden[:, 0])))


class TokenClassificationHead(nn.Module):
    def __init__(self, config: LLMStackMultitaskConfig, num_labels: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.classifier(hidden)


@dataclass
class MultitaskOutput(ModelOutput):
    """The weighted total loss, and per task (in config.tasks order, detached): its loss, and its
    scored targets and those predicted right (tokens for a language model, texts or tokens for a
    classifier)."""

    loss: torch.Tensor | None = None
    task_losses: torch.Tensor | None = None
    task_correct: torch.Tensor | None = None
    task_scored: torch.Tensor | None = None
    task_weights: torch.Tensor | None = None  # each task's weight in the total: given x exp(-s_i) when learned
    logits: dict[str, torch.Tensor] | None = None  # classification tasks' logits, outside training


class LLMStackForMultitask(LLMStackPreTrainedModel):
    config_class = LLMStackMultitaskConfig  # type: ignore[assignment]  # a subclass whose __init__ differs
    config: LLMStackMultitaskConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LLMStackMultitaskConfig) -> None:
        super().__init__(config)
        self.model = LLMStackModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head_classes = {
            "sequence_classification": SequenceClassificationHead,
            "token_classification": TokenClassificationHead,
        }
        self.heads = nn.ModuleDict(
            {
                t["name"]: head_classes[t["kind"]](config, int(t["num_labels"]))
                for t in config.tasks
                if t["kind"] in CLASSIFICATION_KINDS
            }
        )
        if config.learn_task_variance:
            self.task_log_variance = nn.Parameter(torch.zeros(len(config.tasks)))
        self.post_init()

    def forward(
        self,
        tasks: Mapping[str, Mapping[str, torch.Tensor]],
        task_weights: Sequence[float] | None = None,
        num_items: Sequence[float] | None = None,
        **kwargs: Any,
    ) -> MultitaskOutput:
        """Every task's batch (`tasks[name]`: input_ids, attention_mask, and labels or a causal
        LM's shift_labels) through the trunk and its head. A task's loss is its summed loss over
        its scored targets divided by `num_items[i]` (default: their number: the mean); the total
        is sum_i task_weights[i] x L_i (default weights 1), each L_i first weighted by its learned
        variance when the config learns them."""
        losses: list[torch.Tensor] = []
        correct: list[torch.Tensor] = []
        scored: list[torch.Tensor] = []
        logits: dict[str, torch.Tensor] = {}
        for task in self.config.tasks:
            batch = tasks[task["name"]]
            normalizer = None if num_items is None else num_items[len(losses)]
            hidden = self.model(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
            if task["kind"] in LM_KINDS:
                targets = batch["labels"] if task["kind"] == "mlm" else next_token_targets(**_lm_labels(batch))
                assert targets is not None
                with tallying_predictions() as tally:
                    loss, _ = self.head_and_loss(hidden, targets, normalizer)
                assert loss is not None
                right, count = tally.correct, tally.scored
            else:
                task_logits = self.heads[task["name"]](hidden, batch.get("attention_mask"))
                loss, right, count = classification_loss(task_logits, batch["labels"], normalizer)
                if not self.training:
                    logits[task["name"]] = task_logits
            losses.append(loss)
            correct.append(torch.as_tensor(right, device=hidden.device))
            scored.append(torch.as_tensor(count, device=hidden.device))
        stacked = torch.stack([loss.float() for loss in losses])
        weights = torch.ones_like(stacked) if task_weights is None else torch.tensor(task_weights).to(stacked)
        weighted, effective = stacked, weights
        if self.config.learn_task_variance:
            precision = torch.exp(-self.task_log_variance.float())
            weighted, effective = precision * stacked + self.task_log_variance.float() / 2, weights * precision
        return MultitaskOutput(
            loss=(weights * weighted).sum(),
            task_weights=effective.detach(),
            task_losses=stacked.detach(),
            task_correct=torch.stack(correct).detach(),
            task_scored=torch.stack(scored).detach(),
            logits=logits or None,
        )


def _lm_labels(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    return {"labels": batch.get("labels"), "shift_labels": batch.get("shift_labels")}


def classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed cross entropy over the labels that are not IGNORE_INDEX divided by `num_items`,
    default their number; labels predicted right; labels scored)."""
    flat_logits, flat_labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    scored = flat_labels != IGNORE_INDEX
    total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    count = scored.sum()
    loss = total / (count.clamp(min=1) if num_items is None else num_items)
    correct = ((flat_logits.argmax(-1) == flat_labels) & scored).sum()
    return loss, correct.detach(), count


def classification_state_dict(model: LLMStackForMultitask, task: str) -> dict[str, torch.Tensor]:
    """The trunk and `task`'s sequence-classification head under the stock class's names
    (LlamaForSequenceClassification for a decoder, EuroBertForSequenceClassification for an encoder)."""
    kinds = {t["name"]: t["kind"] for t in model.config.tasks}
    if kinds.get(task) != "sequence_classification":
        named = [name for name, kind in kinds.items() if kind == "sequence_classification"]
        raise ValueError(f"task {task!r} is not a sequence classification task of this model; those are: {named}")
    prefix = f"heads.{task}."
    head = {k[len(prefix) :]: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    trunk = {k: v for k, v in model.state_dict().items() if k.startswith("model.")}
    return {**trunk, **head}


__all__ = [
    "TASK_KINDS",
    "LLMStackForMultitask",
    "LLMStackMultitaskConfig",
    "MultitaskOutput",
    "classification_loss",
    "classification_state_dict",
]
