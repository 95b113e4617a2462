"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed"), on torch.distributed.

DeepSpeed removed its implementation in 2026; this one is used with the DeepSpeed engine at ZeRO
stage 0 with the engine's own gradient all-reduce turned off (see deepspeed_integration), or with
no engine at all: it averages the gradients itself. A ds_config at ZeRO stage 1 or 2 gets the
partitioned variant (`partition=True`), which does its own partitioning: DeepSpeed's ZeRO optimizer
would reduce the gradients and gather the weights in full precision.
"""

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT

from .compressed_allreduce import (
    SliceLayout,
    allreduce_mean,
    compressed_all_gather,
    compressed_allreduce,
    compressed_reduce_scatter,
    error_feedback_buffers,
    slice_layout,
)

logger = logging.getLogger(__name__)

# Key of the optimizer-wide entry of `state` (torch.optim.Optimizer keeps non-parameter keys as
# they are in state_dict() and load_state_dict()).
SHARED = "onebit"
ERROR_FEEDBACK = ("worker_error", "server_error")
PARTITION_STATE = ("exp_avg", "exp_avg_sq")  # partitioned mode: this rank's row of each
EXPERTS = "expert_"  # prefix of the expert parameters' entries in SHARED


class Exchange(NamedTuple):
    """Parameters averaged over one process group, their gradients multiplied by `grad_scale`
    first, and the prefix of their entries in the optimizer's SHARED state."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]]  # each parameter's param group
    group: dist.ProcessGroup | None
    grad_scale: float
    prefix: str


class OneBitAdam(torch.optim.Optimizer):
    """Adam whose communication drops to 1 bit per element after `freeze_step` steps.

    Steps 1..freeze_step (the warm-up): gradients are averaged over the data-parallel group in
    full precision and AdamW runs unchanged (bias correction, decoupled weight decay). After it the
    variance and its bias correction are frozen, which makes the update linear in the momentum:
    each rank folds its *local* gradient into the momentum, and the momenta are averaged by a 1-bit
    compressed all-reduce with error feedback on both sides; every rank then applies the same
    averaged momentum. With a group of one rank there is nothing to communicate, and this is Adam
    with the variance frozen after `freeze_step`.

    Partitioned (`partition=True`, ZeRO stages 1 and 2): rank r keeps the momentum and variance of
    the r-th slice of every tensor only (1/W of Adam's state) and updates those slices. In the
    warm-up the gradients are all-reduced and the updated slices all-gathered in fp32 (ZeRO's
    traffic). After it, each rank compresses its local gradient (worker error feedback), the
    compressed all-to-all hands rank r its slices (a reduce-scatter), rank r folds their average
    into its momentum, and the parameter change of its slices (the frozen-variance Adam step) is
    compressed again (server error feedback) and all-gathered: about 2 bits per element, as at
    ZeRO-0. What is compressed differs from ZeRO-0 (the gradient and the step, not the momentum,
    which no rank holds whole), so the two agree exactly in the warm-up and closely after it.

    Expert parameters (param groups marked "moe", as DeepSpeed's MoE groups are) are averaged over
    `expert_group` instead, their gradients scaled by its size over the data-parallel size first
    (DeepSpeed's convention for split experts: summed over the expert-data-parallel ranks after
    the data-parallel division).

    Every parameter of the groups takes part in every step, in group order, so that all ranks
    exchange the same layout; a parameter without a gradient counts as a zero gradient. During the
    warm-up at ZeRO-0 the averaged gradients are written back into `.grad`, as DDP does.

    After the warm-up, elements whose frozen variance is exactly zero never had a gradient: their
    momentum is kept at zero, as it would be without compression (signs cannot represent zero, and
    dividing a compression residue by eps would throw those weights away).

    The error-feedback buffers (and, partitioned, the state slices) differ between ranks. Once
    compression has started, state_dict() is therefore a collective over the group: it gathers
    every rank's, so that the single file data-parallel rank 0 writes (DeepSpeed's ZeRO-0
    checkpoints) restores every rank. Resuming with another world size re-slices the partitioned
    state exactly and restarts the error feedback from zero.

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
        partition: bool = False,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"invalid lr={lr}, eps={eps} or weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1); got {betas}")
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be at least 1; got {freeze_step}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        if partition and len({g["betas"] for g in self.param_groups}) > 1:
            raise ValueError("partitioned 1-bit Adam needs the same betas in every param group")
        self.freeze_step = freeze_step
        self.group = group
        self.expert_group = expert_group
        self.partition = partition
        self.last_step_bytes = 0
        self._gathered: dict[str, Any] | None = None  # see gathered_state
        self.state[SHARED] = {"step": 0}  # type: ignore[index]  # a str key, see SHARED

    @property
    def world_size(self) -> int:
        return _size(self.group)

    def exchanges(self) -> list[Exchange]:
        """The parameters grouped by the process group their gradients are averaged over."""
        dense = [(g, p) for g in self.param_groups if not g.get("moe") for p in g["params"]]
        experts = [(g, p) for g in self.param_groups if g.get("moe") for p in g["params"]]
        result = [Exchange([p for _, p in dense], [g for g, _ in dense], self.group, 1.0, "")] if dense else []
        if experts:
            scale = _size(self.expert_group) / self.world_size
            result.append(Exchange([p for _, p in experts], [g for g, _ in experts], self.expert_group, scale, EXPERTS))
        return result

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        shared = self.state[SHARED]  # type: ignore[index]
        shared["step"] += 1
        self.last_step_bytes = 0
        for exchange in self.exchanges():
            if self.partition:
                self._partitioned_step(exchange, shared["step"])
            else:
                self._replicated_step(exchange, shared["step"])
        return loss

    def _replicated_step(self, exchange: Exchange, step: int) -> None:
        """ZeRO-0: every rank holds the whole state and applies the same averaged momentum."""
        params, groups = exchange.params, exchange.groups
        for p in params:
            if p not in self.state:
                self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        grads = _local_grads(params, exchange.grad_scale)
        communicates = _size(exchange.group) > 1
        if step > self.freeze_step:
            for group, p, grad in zip(groups, params, grads):
                self.state[p]["exp_avg"].lerp_(grad, 1 - group["betas"][0])
            if communicates:
                self._average_momentum(exchange)
        else:
            if communicates:
                flat = torch.cat([g.reshape(-1) for g in grads])
                self.last_step_bytes += allreduce_mean(flat, exchange.group)
                _unflatten_into(flat, grads)
            for group, p, grad in zip(groups, params, grads):
                beta1, beta2 = group["betas"]
                self.state[p]["exp_avg"].lerp_(grad, 1 - beta1)
                self.state[p]["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        variance_step = min(step, self.freeze_step)
        for group, p in zip(groups, params):
            beta1, beta2 = group["betas"]
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            bias_correction1 = 1 - beta1**step
            bias_correction2_sqrt = (1 - beta2**variance_step) ** 0.5
            denom = (self.state[p]["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["eps"])
            p.addcdiv_(self.state[p]["exp_avg"], denom, value=-group["lr"] / bias_correction1)

    def _average_momentum(self, exchange: Exchange) -> None:
        """Replace every rank's momentum by the 1-bit compressed average over the group."""
        momenta = [self.state[p]["exp_avg"] for p in exchange.params]
        worker, server = self._error_feedback(exchange, slice_layout(momenta, _size(exchange.group)))
        self.last_step_bytes += compressed_allreduce(momenta, worker, server, exchange.group)
        for p, m in zip(exchange.params, momenta):
            m.masked_fill_(self.state[p]["exp_avg_sq"] == 0, 0.0)

    def _partitioned_step(self, exchange: Exchange, step: int) -> None:
        """ZeRO 1/2: this rank updates its row of the exchange's slice layout (see the class doc)."""
        params, group = exchange.params, exchange.group
        world_size, rank = _size(group), _rank(group)
        layout = slice_layout(params, world_size)
        shared = self.state[SHARED]  # type: ignore[index]
        exp_avg, exp_avg_sq = (
            shared.setdefault(exchange.prefix + key, params[0].new_zeros(1, layout.width)) for key in PARTITION_STATE
        )
        beta1, beta2 = exchange.groups[0]["betas"]
        # Per column of the layout: the step size lr / bias correction (computed in double precision,
        # as the replicated step's scalar is) and eps, from each parameter's param group.
        step_size = params[0].new_tensor([g["lr"] / (1 - beta1**step) for g in exchange.groups])[layout.segment_ids]
        eps = params[0].new_tensor([g["eps"] for g in exchange.groups])[layout.segment_ids]
        grads = layout.rows(_local_grads(params, exchange.grad_scale))
        for p, param_group in zip(params, exchange.groups):  # every rank decays its whole copy alike
            if param_group["weight_decay"]:
                p.mul_(1 - param_group["lr"] * param_group["weight_decay"])
        bias_correction2_sqrt = (1 - beta2 ** min(step, self.freeze_step)) ** 0.5
        if step > self.freeze_step:
            if world_size > 1:
                worker, server = self._error_feedback(exchange, layout)
                grad, sent = compressed_reduce_scatter(grads, worker, layout, group)
                self.last_step_bytes += sent
            else:
                grad = grads
            exp_avg.lerp_(grad, 1 - beta1).masked_fill_(exp_avg_sq == 0, 0.0)
            change = exp_avg.div((exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)).mul_(step_size)
            if world_size > 1:
                changes, sent = compressed_all_gather(change, server, layout, group)
                self.last_step_bytes += sent
            else:
                changes = change
            updates = [torch.empty_like(p) for p in params]
            layout.scatter(changes, updates)
            for p, update in zip(params, updates):
                p.sub_(update)
            return
        if world_size > 1:
            self.last_step_bytes += allreduce_mean(grads, group)
        grad = grads[rank : rank + 1]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        weights = layout.rows(params)  # decayed above; this rank's row takes its Adam step
        mine = weights[rank : rank + 1]
        mine.sub_(exp_avg.div((exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)).mul_(step_size))
        if world_size > 1:
            dist.all_gather(list(weights.unbind(0)), mine[0].clone(), group=group)
            self.last_step_bytes += (world_size - 1) * layout.width * weights.element_size()
        layout.scatter(weights, params)

    def _error_feedback(self, exchange: Exchange, layout: SliceLayout) -> tuple[torch.Tensor, torch.Tensor]:
        shared = self.state[SHARED]  # type: ignore[index]
        worker, server = (exchange.prefix + key for key in ERROR_FEEDBACK)
        if worker not in shared:
            shared[worker], shared[server] = error_feedback_buffers(layout)
        return shared[worker], shared[server]

    @contextlib.contextmanager
    def gathered_state(self) -> Iterator[None]:
        """Every rank enters together: within, state_dict() returns what one collective gather
        gave on entry, so a caller that asks on some ranks only does not wait for the others
        (DeepSpeed's MoE checkpoint asks again on data-parallel rank 0 alone)."""
        self._gathered = self.state_dict()
        try:
            yield
        finally:
            self._gathered = None

    def state_dict(self) -> dict[str, Any]:
        if self._gathered is not None:
            return self._gathered
        state_dict = super().state_dict()
        shared = dict(state_dict["state"][SHARED])
        for exchange in self.exchanges():
            for key in (*ERROR_FEEDBACK, *PARTITION_STATE):
                if exchange.prefix + key in shared:
                    shared[exchange.prefix + key] = _gather(shared[exchange.prefix + key], exchange.group)
        state_dict["state"][SHARED] = shared
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["state"][SHARED]
        shared = {k: v for k, v in saved.items() if not torch.is_tensor(v)}
        device = self.param_groups[0]["params"][0].device
        for exchange in self.exchanges():
            world_size, rank = _size(exchange.group), _rank(exchange.group)
            for key in PARTITION_STATE:
                if exchange.prefix + key in saved:
                    rows = _reslice(saved[exchange.prefix + key].to(device), exchange.params, world_size)
                    shared[exchange.prefix + key] = rows[rank : rank + 1].clone()
            worker = saved.get(exchange.prefix + "worker_error")
            if worker is None:
                continue
            if len(worker) == world_size:
                shared.update(
                    {
                        exchange.prefix + k: saved[exchange.prefix + k][rank].to(device, copy=True)
                        for k in ERROR_FEEDBACK
                    }
                )
            else:
                logger.warning(
                    "OneBitAdam: the checkpoint was saved by %d ranks and is resumed on %d; "
                    "the compression error feedback restarts from zero.",
                    len(worker),
                    world_size,
                )
        super().load_state_dict({**state_dict, "state": {**state_dict["state"], SHARED: shared}})


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _local_grads(params: Sequence[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros where it has none), times `scale` unless that is 1."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return grads if scale == 1.0 else [g * scale for g in grads]


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(world size, *tensor.shape): every rank's `tensor`, in group rank order."""
    gathered = torch.empty(_size(group), *tensor.shape, dtype=tensor.dtype, device=tensor.device)
    if _size(group) == 1:
        gathered[0].copy_(tensor)
    else:
        dist.all_gather(list(gathered.unbind(0)), tensor.contiguous(), group=group)
    return gathered


def _reslice(saved: torch.Tensor, params: Sequence[torch.Tensor], world_size: int) -> torch.Tensor:
    """Partitioned state gathered from W ranks (W, 1, width) as the (world_size, width') rows of the
    same tensors sliced for `world_size` ranks (the same rows when W == world_size)."""
    rows = saved.reshape(saved.shape[0], -1)
    if rows.shape[0] == world_size:
        return rows
    whole = [torch.empty_like(p) for p in params]
    SliceLayout([p.numel() for p in params], rows.shape[0], rows.device).scatter(rows, whole)
    return slice_layout(whole, world_size).rows(whole)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of the 1-D `flat` into `tensors`."""
    for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(piece.view_as(tensor))
