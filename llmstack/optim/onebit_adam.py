"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed"), on torch.distributed.

DeepSpeed removed its implementation in 2026; this one is used with the DeepSpeed engine at ZeRO
stage 0 with the engine's own gradient all-reduce turned off (see deepspeed_integration), or with
no engine at all: it averages the gradients itself.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT

from .compressed_allreduce import (
    allreduce_mean,
    compressed_allreduce,
    error_feedback_buffers,
    slice_layout,
)

logger = logging.getLogger(__name__)

# Key of the optimizer-wide entry of `state` (torch.optim.Optimizer keeps non-parameter keys as
# they are in state_dict() and load_state_dict()).
SHARED = "onebit"
ERROR_FEEDBACK = ("worker_error", "server_error")


class OneBitAdam(torch.optim.Optimizer):
    """Adam whose communication drops to 1 bit per element after `freeze_step` steps.

    Steps 1..freeze_step (the warm-up): gradients are averaged over the data-parallel group in
    full precision and AdamW runs unchanged (bias correction, decoupled weight decay). After it the
    variance and its bias correction are frozen, which makes the update linear in the momentum:
    each rank folds its *local* gradient into the momentum, and the momenta are averaged by a 1-bit
    compressed all-reduce with error feedback on both sides; every rank then applies the same
    averaged momentum. With a group of one rank there is nothing to communicate, and this is Adam
    with the variance frozen after `freeze_step`.

    Every parameter of the groups takes part in every step, in group order, so that all ranks
    exchange the same layout; a parameter without a gradient counts as a zero gradient. During the
    warm-up the averaged gradients are written back into `.grad`, as DDP does.

    After the warm-up, elements whose frozen variance is exactly zero never had a gradient: their
    momentum is kept at zero, as it would be without compression (signs cannot represent zero, and
    dividing a compression residue by eps would throw those weights away).

    The error-feedback buffers differ between ranks. Once compression has started, state_dict() is
    therefore a collective over the group: it gathers every rank's buffers, so that the single file
    data-parallel rank 0 writes (DeepSpeed's ZeRO-0 checkpoints) restores every rank. That costs
    world-size copies of the model in the saved state. Resuming with another world size restarts
    the error feedback from zero.

    `last_step_bytes` is the number of bytes this rank sent in the latest step.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100_000,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"invalid lr={lr}, eps={eps} or weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1); got {betas}")
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be at least 1; got {freeze_step}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.freeze_step = freeze_step
        self.group = group
        self.last_step_bytes = 0
        self.state[SHARED] = {"step": 0}  # type: ignore[index]  # a str key, see SHARED

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        shared = self.state[SHARED]  # type: ignore[index]
        shared["step"] += 1
        step = shared["step"]
        frozen = step > self.freeze_step
        pairs = [(group, p) for group in self.param_groups for p in group["params"]]
        for _, p in pairs:
            if p not in self.state:
                self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in pairs]

        self.last_step_bytes = 0
        if frozen:
            for (group, p), grad in zip(pairs, grads):
                self.state[p]["exp_avg"].lerp_(grad, 1 - group["betas"][0])
            if self.world_size > 1:
                self._average_momentum([p for _, p in pairs])
        else:
            if self.world_size > 1:
                flat = torch.cat([g.reshape(-1) for g in grads])
                self.last_step_bytes = allreduce_mean(flat, self.group)
                _unflatten_into(flat, grads)
            for (group, p), grad in zip(pairs, grads):
                beta1, beta2 = group["betas"]
                self.state[p]["exp_avg"].lerp_(grad, 1 - beta1)
                self.state[p]["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        variance_step = min(step, self.freeze_step)
        for group, p in pairs:
            beta1, beta2 = group["betas"]
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            bias_correction1 = 1 - beta1**step
            bias_correction2_sqrt = (1 - beta2**variance_step) ** 0.5
            denom = (self.state[p]["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["eps"])
            p.addcdiv_(self.state[p]["exp_avg"], denom, value=-group["lr"] / bias_correction1)
        return loss

    def _average_momentum(self, params: Sequence[torch.Tensor]) -> None:
        """Replace every rank's momentum by the 1-bit compressed average over the group."""
        momenta = [self.state[p]["exp_avg"] for p in params]
        shared = self.state[SHARED]  # type: ignore[index]
        if "worker_error" not in shared:
            layout = slice_layout(momenta, self.world_size)
            shared["worker_error"], shared["server_error"] = error_feedback_buffers(layout)
        self.last_step_bytes = compressed_allreduce(momenta, shared["worker_error"], shared["server_error"], self.group)
        for p, m in zip(params, momenta):
            m.masked_fill_(self.state[p]["exp_avg_sq"] == 0, 0.0)

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        shared = dict(state_dict["state"][SHARED])
        for key in ERROR_FEEDBACK:
            if key in shared:
                shared[key] = self._gather(shared[key])
        state_dict["state"][SHARED] = shared
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["state"][SHARED]
        shared = {k: v for k, v in saved.items() if k not in ERROR_FEEDBACK}
        if "worker_error" in saved:
            saved_world_size = len(saved["worker_error"])
            if saved_world_size == self.world_size:
                device = self.param_groups[0]["params"][0].device
                rank = dist.get_rank(self.group)
                shared.update({key: saved[key][rank].to(device, copy=True) for key in ERROR_FEEDBACK})
            else:
                logger.warning(
                    "OneBitAdam: the checkpoint was saved by %d ranks and is resumed on %d; "
                    "the compression error feedback restarts from zero.",
                    saved_world_size,
                    self.world_size,
                )
        super().load_state_dict({**state_dict, "state": {**state_dict["state"], SHARED: shared}})

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(world size, *tensor.shape): every rank's `tensor`, in group rank order."""
        gathered = torch.empty(self.world_size, *tensor.shape, dtype=tensor.dtype, device=tensor.device)
        dist.all_gather(list(gathered.unbind(0)), tensor.contiguous(), group=self.group)
        return gathered


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the 1-D `flat` into `tensors`."""
    for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(piece.view_as(tensor))
