"""Mixture-of-experts MLP: a top-k router over SwiGLU experts, in Mixtral's layout.

Parameter names are those of transformers' `MixtralSparseMoeBlock`, so an llmstack MoE model and a
stock `MixtralForCausalLM` share one state dict:

    mlp.gate.weight             (experts, hidden)                     the router
    mlp.experts.gate_up_proj    (experts, 2 x intermediate, hidden)   gate rows, then up rows
    mlp.experts.down_proj       (experts, hidden, intermediate)
    mlp.shared_experts.*        an always-on SwiGLU added to the routed output (DeepSeek/Qwen2-MoE
                                style; Mixtral has none)

Routing: router logits in fp32, softmax, the top k experts per token, their probabilities
renormalized to sum to 1 (Mixtral; `moe_norm_topk_prob=False` keeps the raw probabilities).

Dropless by default: every (token, expert) assignment is computed, as in Mixtral and Megatron's
dropless MoE, so the model computes the same whatever the batch. With `moe_capacity_factor` c an
expert takes at most ceil(c x tokens x k / experts) of one forward pass's assignments, in token
order (Switch/GShard); the others are dropped (contribute nothing, the residual carries the token
on) and counted in the router statistics.

Auxiliary losses, per MoE layer (the model averages them over its MoE layers):
    load balancing (Switch eq. 4 in Mixtral's top-k form): E x sum_e f_e x P_e, f_e the
        assignments to expert e per token (so sum_e f_e = k), P_e its mean router probability;
        perfectly balanced routing gives k. transformers' `load_balancing_loss_func` pools f and P
        over all layers before the product; per layer (as Megatron) balances each layer on its
        own. The two agree for one layer.
    router z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2.
Both count only the tokens of the forward pass that are neither padding (attention_mask 0) nor
ignored (label -100), as transformers' `load_balancing_loss_func` given an attention mask. The model
hands its MoE blocks one `RouterRecord` per forward pass, which carries that mask
(`router_token_mask`) in and each block's statistics out; the routing statistics count every token.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llmstack import LLMStackConfig
from .loss import IGNORE_INDEX


@dataclass
class RouterStats:
    """One MoE layer's routing in one forward pass (this process's tokens)."""

    load: torch.Tensor  # (experts,) fraction of the assignments routed to each expert (sums to 1)
    dropped: torch.Tensor  # assignments dropped by the capacity limit (0 when dropless)
    aux_loss: torch.Tensor  # load-balancing loss, with gradient
    z_loss: torch.Tensor  # router z-loss, with gradient


@dataclass
class RouterRecord:
    """One forward pass's MoE routing: the tokens the auxiliary losses count (`token_mask`, from
    router_token_mask; all when None), in, and each MoE block's RouterStats in layer order, out."""

    token_mask: torch.Tensor | None = None
    stats: list[RouterStats] = field(default_factory=list)


@dataclass
class MoECausalLMOutputWithPast(CausalLMOutputWithPast):
    """A causal LM output with its MoE layers' routing: `aux_loss` and `router_z_loss` averaged over
    the layers (their weighted sum is already in `loss`), and each layer's `RouterStats`."""

    aux_loss: torch.Tensor | None = None
    router_z_loss: torch.Tensor | None = None
    router_stats: list[RouterStats] | None = None


def load_balancing_loss(
    probs: torch.Tensor, experts: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """E x sum_e f_e x P_e of router probabilities (tokens, E) and chosen experts (tokens, k), over
    the tokens `token_mask` (tokens,) keeps (all when None)."""
    if token_mask is not None:
        probs, experts = probs[token_mask], experts[token_mask]
    num_tokens, num_experts = probs.shape
    assignments = torch.zeros(num_experts, device=probs.device).index_add_(
        0, experts.reshape(-1), torch.ones(experts.numel(), device=probs.device)
    )
    return num_experts * torch.sum(assignments * probs.sum(0)) / max(num_tokens, 1) ** 2


def router_z_loss(logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the tokens `token_mask` keeps (all when None) of logsumexp(logits)^2."""
    if token_mask is not None:
        logits = logits[token_mask]
    return torch.logsumexp(logits, dim=-1).pow(2).sum() / max(logits.shape[0], 1)


def router_token_mask(
    seq_len: int, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
) -> torch.Tensor | None:
    """The flattened (batch x seq_len) bool mask of the positions the auxiliary losses count: not
    padding (attention_mask 0) and not ignored (label -100; `labels` aligned with the positions);
    None when every position counts. Masks longer than the positions (generation with a cache)
    are read at their last seq_len positions."""
    masks = [attention_mask[:, -seq_len:].bool()] if attention_mask is not None else []
    masks += [labels[:, -seq_len:] != IGNORE_INDEX] if labels is not None else []
    if not masks:
        return None
    mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
    return None if bool(mask.all()) else mask.reshape(-1)


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Bool (tokens, k): whether each assignment is among the first `capacity` of its expert, counting
    in token order (a token's first choice before its second)."""
    one_hot = F.one_hot(experts.reshape(-1), num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place of each assignment in its expert's queue
    return (position < capacity).reshape(experts.shape)


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits (tokens, experts) of hidden states (tokens, hidden)."""
        return F.linear(x.float(), self.weight.float())


class Experts(nn.Module):
    """SwiGLU experts stored as 3-D tensors (Mixtral's `MixtralExperts`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `x` grouped by expert, counts[e] rows for expert e (of this module), through their experts."""
        outputs = []
        for e, rows in enumerate(x.split(counts)):
            if len(rows):
                gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
                outputs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outputs) if outputs else x[:0]


# (rows grouped by global expert, rows per global expert, experts) -> expert outputs in the same order
Dispatcher = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is on this process: run them directly."""
    return experts(x, counts.tolist())


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class ExpertShare:
    """Which of the router's experts an MoE block computes: `count` experts from `first` (all of
    them when `count` is None). A block computing a share reads the tokens and routing weights
    through `enter` and adds its partial output to the other shares' through `combine`
    (llmstack.parallel.tensor_parallel sets both; unchanged by default)."""

    first: int = 0
    count: int | None = None
    enter: Callable[[torch.Tensor], torch.Tensor] = _unchanged
    combine: Callable[[torch.Tensor], torch.Tensor] = _unchanged


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts, plus an optional always-on shared expert.

    Two seams let parallelism be applied from outside: `dispatch` moves the grouped rows to the
    experts and back (expert parallelism, llmstack.parallel.expert_parallel, replaces it, and
    `experts`, with this rank's share), and `share` says which of the router's experts this block
    computes (tensor parallelism gives each rank a range of whole experts, see ExpertShare).
    A forward pass given a RouterRecord counts its token mask and appends the layer's RouterStats.
    """

    def __init__(self, config: LLMStackConfig, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.moe_norm_topk_prob
        self.capacity_factor = config.moe_capacity_factor
        self.gate = TopKRouter(config.hidden_size, self.num_experts)
        self.experts = Experts(self.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = shared_experts
        self.dispatch: Dispatcher = local_dispatch
        self.share = ExpertShare()

    def forward(self, x: torch.Tensor, router: RouterRecord | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        kept = torch.ones_like(experts, dtype=torch.bool)
        if self.capacity_factor is not None and self.training:
            capacity = math.ceil(self.capacity_factor * flat.shape[0] * self.top_k / self.num_experts)
            kept = within_capacity(experts, self.num_experts, capacity)
        if router is not None:
            router.stats.append(
                RouterStats(
                    load=torch.bincount(experts.reshape(-1), minlength=self.num_experts).float() / experts.numel(),
                    dropped=(~kept).sum(),
                    aux_loss=load_balancing_loss(probs, experts, router.token_mask),
                    z_loss=router_z_loss(logits, router.token_mask),
                )
            )
        out = self.routed(flat, experts[kept], weights[kept], kept.nonzero()[:, 0])
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(x.shape)

    def routed(
        self,
        flat: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor:
        """Sum over the kept assignments (token, expert, weight) to this block's share of the
        experts of weight x expert(token), combined with the other shares' sums."""
        share = self.share
        flat, weights = share.enter(flat), share.enter(weights)
        num_experts = share.count or self.num_experts
        if share.count is not None:
            local = experts - share.first
            mine = (local >= 0) & (local < share.count)
            experts, weights, tokens = local[mine], weights[mine], tokens[mine]
        order = torch.argsort(experts, stable=True)
        tokens = tokens[order]
        counts = torch.bincount(experts, minlength=num_experts)
        y = self.dispatch(flat[tokens], counts, self.experts)
        y = y * weights[order, None]
        return share.combine(torch.zeros_like(flat).index_add_(0, tokens, y.to(flat.dtype)))


class RouterStatsWindow:
    """Routing statistics summed over the forward passes of a logging window, as metrics:

        moe/aux_loss, moe/z_loss              mean over passes and MoE layers
        moe/dropped_tokens                    dropped assignments per pass, all MoE layers
        moe/load/layer{L}/expert{e}           fraction of layer L's assignments routed to expert e
        moe/imbalance/layer{L}, moe/imbalance max/mean load of layer L, and the worst layer's

    `totals()` are plain sums, so that a caller can add them over data-parallel ranks before
    `metrics()` turns them into means.
    """

    def __init__(self, layers: list[int], num_experts: int) -> None:
        self.layers, self.num_experts = layers, num_experts
        self.sums = torch.zeros(len(layers) * num_experts + 4, dtype=torch.float64)

    def add(self, stats: list[RouterStats], layers: list[int] | None = None) -> None:
        """One forward pass's statistics of `layers` (all MoE layers by default; a pipeline stage
        adds its own, and the stages' totals are summed before `metrics`)."""
        with torch.no_grad():
            load = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64)
            for layer, layer_stats in zip(self.layers if layers is None else layers, stats):
                load[self.layers.index(layer)] = layer_stats.load.double().cpu()
            scalars = [sum(float(getattr(s, name)) for s in stats) for name in ("aux_loss", "z_loss", "dropped")]
            self.sums += torch.cat([load.reshape(-1), torch.tensor([*scalars, 1.0], dtype=torch.float64)])

    def totals(self) -> list[float]:
        return self.sums.tolist()

    def metrics(self, totals: list[float]) -> dict[str, float]:
        """Metrics of `totals` (this window's, possibly summed over ranks); starts a new window."""
        self.sums.zero_()
        *load_sums, aux, z, dropped, passes = totals
        if not passes:
            return {}
        load = torch.tensor(load_sums).view(len(self.layers), self.num_experts) / passes
        imbalance = load.max(1).values * self.num_experts  # the mean load is 1 / experts
        metrics = {
            "moe/aux_loss": aux / passes / len(self.layers),
            "moe/z_loss": z / passes / len(self.layers),
            "moe/dropped_tokens": dropped / passes,
            "moe/imbalance": float(imbalance.max()),
        }
        for row, layer in enumerate(self.layers):
            metrics[f"moe/imbalance/layer{layer}"] = float(imbalance[row])
            metrics.update({f"moe/load/layer{layer}/expert{e}": float(load[row, e]) for e in range(self.num_experts)})
        return metrics


def moe_layer_indices(config: LLMStackConfig) -> list[int]:
    """The layers whose MLP is an MoE block (none when num_local_experts is 0)."""
    if not config.num_local_experts:
        return []
    if config.moe_layers is not None:
        return list(config.moe_layers)
    return list(range(config.num_hidden_layers))


__all__ = [
    "ExpertShare",
    "Experts",
    "MoEBlock",
    "MoECausalLMOutputWithPast",
    "RouterRecord",
    "RouterStats",
    "RouterStatsWindow",
    "TopKRouter",
    "load_balancing_loss",
    "local_dispatch",
    "moe_layer_indices",
    "router_token_mask",
    "router_z_loss",
    "within_capacity",
]
