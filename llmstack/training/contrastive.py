"""Contrastive training of an embedding model (train.objective: contrastive): InfoNCE with a
temperature over in-batch negatives gathered from every data-parallel rank, optionally with a
MoCo queue of earlier keys (.momentum), and retrieval recall on held-out pairs.

For query i and keys k_1..k_N (its positive among them), with unit-length vectors and
temperature T, the loss is -log(exp(q_i.k_pos / T) / sum_j exp(q_i.k_j / T)), averaged over the
queries. The keys are every rank's positives (llmstack.parallel.batch_gather, the gradient
flowing back to the rank that computed each), then the queue's keys when there is a queue (no
gradient: they come from the momentum encoder). Each micro-batch is its own contrastive batch:
its negatives are the positives of that micro-batch on every rank, not those of the other
micro-batches of a gradient-accumulation step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from llmstack.data.pairs import PairData, split_pairs
from llmstack.parallel.batch_gather import gather_batch

from .momentum import MomentumEncoder
from .train_model import Batch, EngineModel

RECALL_AT = (1, 10)


def info_nce(
    queries: torch.Tensor,
    keys: torch.Tensor,
    temperature: float,
    first_positive: int = 0,
    negatives: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean InfoNCE loss of unit-length `queries` (n, d) whose positives are keys[first_positive:
    first_positive + n], every other key and each row of `negatives` (m, d) a negative."""
    candidates = keys if negatives is None else torch.cat([keys, negatives.to(keys.dtype)])
    logits = queries @ candidates.T / temperature
    targets = torch.arange(queries.shape[0], device=queries.device) + first_positive
    return F.cross_entropy(logits, targets)


def unit(embeddings: torch.Tensor) -> torch.Tensor:
    return F.normalize(embeddings.float(), dim=-1)


@dataclasses.dataclass
class ContrastiveModel(EngineModel):
    """DeepSpeed's engine over an embedding model, trained by InfoNCE one micro-batch at a time."""

    temperature: float = 0.05
    momentum: MomentumEncoder | None = None

    def train_step(self, micro_batches: Sequence[Batch], num_items_in_batch: float) -> float:
        """One optimizer step; returns this rank's loss, the mean over its micro-batches (the
        mean over the ranks is the loss one process computes on the global batch).
        `num_items_in_batch` is unused: each query weighs the same."""
        group, rank = self.topology.data_parallel_group, self.topology.data_parallel_rank
        total = torch.zeros((), dtype=torch.float64)
        for batch in micro_batches:
            assert isinstance(batch, dict)  # pair batches (llmstack.data.pairs)
            with self.timer.phase("forward"):
                queries, positives = split_pairs(batch)
                if self.momentum is None:  # queries and positives in one pass (SimCSE: two dropout masks)
                    embeddings = self.engine(**batch).embeddings
                else:
                    embeddings = self.engine(**queries).embeddings
                pooled = embeddings.detach().requires_grad_()
                if self.momentum is None:
                    mine, local_keys = unit(pooled).chunk(2)
                else:
                    mine, local_keys = unit(pooled), self.momentum.keys(positives)
                keys = gather_batch(local_keys, group)
                queue = None if self.momentum is None else self.momentum.queue
                loss = info_nce(mine, keys, self.temperature, rank * mine.shape[0], queue)
            with self.timer.phase("backward"):
                # The loss's gradient with respect to the pooled embeddings first (the gather's
                # all-reduce runs here), then the model's: no collective of ours inside DeepSpeed's
                # backward, whose gradient reductions (ZeRO) every rank issues in its own order.
                loss.backward()
                self.engine.backward((embeddings * pooled.grad).sum())
            with self.timer.phase("optimizer"):
                self.engine.step()
                self.loss_scale_guard.after_step()
            if self.momentum is not None:
                self.momentum.enqueue(keys)
            total += loss.detach().double().cpu()
        if self.momentum is not None:
            self.momentum.update(self.engine.module.parameters())
        return total.item() / len(micro_batches)

    def evaluate(self, batches: Iterable[Batch], samples_per_rank: int, micro_batch_size: int) -> dict[str, float]:
        """Retrieval recall (see `retrieval_recall`) over `batches`, which every rank reads whole."""
        was_training = self.engine.training
        self.engine.eval()
        try:
            return retrieval_recall(lambda batch: self.engine(**batch).embeddings, batches)
        finally:
            self.engine.train(was_training)


@torch.no_grad()
def retrieval_recall(
    embed: Callable[[dict[str, torch.Tensor]], torch.Tensor], batches: Iterable[Batch]
) -> dict[str, float]:
    """recall@k (k in RECALL_AT): the share of queries whose own positive is among the k
    positives of all pairs most similar to them by cosine similarity (ties counted in the
    query's favour), with `embed` mapping a batch of texts to embeddings."""
    queries, positives = [], []
    for batch in batches:
        assert isinstance(batch, dict)
        query_batch, positive_batch = split_pairs(batch)
        queries.append(unit(embed(query_batch)))
        positives.append(unit(embed(positive_batch)))
    q, p = torch.cat(queries), torch.cat(positives)
    similarity = q @ p.T
    rank = (similarity > similarity.diagonal().unsqueeze(1)).sum(1)
    return {f"recall@{k}": float((rank < k).float().mean()) for k in RECALL_AT} | {"pairs": q.shape[0]}


def held_out_batches(data: PairData, samples: int, micro_batch_size: int) -> Iterable[Batch]:
    """The first `samples` pairs, whole, in batches (every rank reads them all: the same forward
    passes on every rank, which ZeRO-3's parameter gathering needs)."""
    return data.eval_batches(min(samples, data.num_blocks), micro_batch_size, 0, 1)
