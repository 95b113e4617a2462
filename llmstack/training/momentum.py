"""MoCo's momentum encoder and queue of keys: negatives far beyond one batch (65,536 and more).

The key encoder is a frozen copy of the model that follows it slowly, theta_k <- m theta_k +
(1 - m) theta_q after every optimizer step, so the keys of the last steps, kept in a first-in
first-out queue, stay comparable with today's queries. The queue starts as random unit vectors
drawn from the run's seed (the same on every rank); every rank holds the same encoder and queue
(the keys enqueued are the whole global batch's), which rank 0 saves with each checkpoint and
every rank restores on resume (`state_dict`).

The key encoder updates from whole parameters: ZeRO stages 0-2 (the layout table refuses ZeRO-3).
"""

import copy
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


class MomentumEncoder:
    def __init__(self, model: nn.Module, queue_size: int, momentum: float, seed: int = 0) -> None:
        """`model`: the embedding model as built, before training (its copy starts the key encoder)."""
        self.encoder = copy.deepcopy(model).eval().requires_grad_(False)
        self.momentum = momentum
        dim = int(cast(Any, model).config.hidden_size)
        generator = torch.Generator().manual_seed(seed)
        self.queue = F.normalize(torch.randn(queue_size, dim, generator=generator), dim=-1)
        self.pointer = 0  # the oldest key's row, replaced next

    def to(self, device: torch.device, dtype: torch.dtype) -> "MomentumEncoder":
        """The key encoder in the engine's device and training dtype; the queue stays fp32."""
        self.encoder.to(device=device, dtype=dtype)
        self.queue = self.queue.to(device)
        return self

    @torch.no_grad()
    def keys(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Unit-length key embeddings of a batch of texts (no dropout: the key encoder is in eval mode)."""
        return F.normalize(self.encoder(**batch).embeddings.float(), dim=-1)

    @torch.no_grad()
    def update(self, parameters: Iterable[torch.Tensor]) -> None:
        """One momentum step towards the trained model's `parameters` (in the order of the model's)."""
        own = list(self.encoder.parameters())
        trained = list(parameters)
        if len(own) != len(trained):
            raise ValueError(f"the key encoder has {len(own)} parameters, the trained model {len(trained)}")
        for key, query in zip(own, trained):
            key.mul_(self.momentum).add_(query.detach().to(key.dtype), alpha=1.0 - self.momentum)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """Replace the oldest rows of the queue by `keys` (the global batch's), wrapping around."""
        rows = (self.pointer + torch.arange(keys.shape[0], device=self.queue.device)) % self.queue.shape[0]
        self.queue[rows] = keys.detach().float()
        self.pointer = int(rows[-1] + 1) % self.queue.shape[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        encoder = {f"encoder.{name}": t.detach().cpu() for name, t in self.encoder.state_dict().items()}
        return {"queue": self.queue.cpu(), "pointer": torch.tensor(self.pointer), **encoder}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["queue"].shape != self.queue.shape:
            raise ValueError(
                f"the checkpoint's key queue is {tuple(state['queue'].shape)}, this run's {tuple(self.queue.shape)}: "
                "resume with the train.queue_size it was saved with"
            )
        self.queue.copy_(state["queue"])
        self.pointer = int(state["pointer"])
        encoder = {name[len("encoder.") :]: t for name, t in state.items() if name.startswith("encoder.")}
        self.encoder.load_state_dict(encoder)
