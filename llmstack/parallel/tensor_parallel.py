"""Tensor parallelism for the llmstack model, applied from outside its definition.

`parallelize(model, topology)` rewrites a plain `LLMStackForCausalLM` or `LLMStackForMaskedLM` in place:

    attention   q, k, v column-parallel (this rank's heads and key/value heads), o row-parallel
    MLP         gate, up column-parallel (this rank's columns), down row-parallel
    MoE MLP     this rank's share of the experts (whole experts: see TensorParallelExperts); the
                router replicated; a shared expert split as the MLP
    embedding   vocabulary-parallel; lm_head column-parallel over the vocabulary, logits left split
    loss        vocab_parallel_cross_entropy

Each split layer takes this rank's slice of the existing weights, so the model computes the same
function as before, on the same initialization. Norms are replicated.

The model's forward code runs unchanged (`Attention.forward` reads the head counts from the weight
shapes): the split is a per-module plan of replaced layers and forward hooks, with no class of a
model object changed. Attention and MLP enter the tensor-parallel region once for all their
projections (a forward pre-hook: one gradient all-reduce per sub-layer, not one per projection),
and attention dropout draws from the tensor-parallel random stream (hooks around the module); the
MoE block computes a share of whole experts (its `share`, see TensorParallelExperts). The output
layer becomes a `VocabParallelHead`, which the model (causal or masked LM alike) asks for its loss
(vocab_parallel_cross_entropy; in training, from the hidden states a chunk of tokens at a time,
with no logits returned); its logits are this rank's vocabulary slice.

With `sequence_parallel=True`, the activations between sub-layers are split along the sequence
instead of replicated (Megatron-LM's sequence parallelism): norms and dropout there process 1/tp of
the tokens, dropout draws from the tensor-parallel stream, and the gradients of the replicated
parameters (the norms), now partial sums over this rank's tokens, are summed over the group. The
model then computes whole causal blocks only (no padding mask, KV cache or logits_to_keep), with
a sequence length divisible by the tensor-parallel size; pipelines do not use it.

Uneven splits: attention heads and key/value heads must divide by the tensor-parallel size
(`UserError` otherwise). The vocabulary and the MLP width need not: they are split into shards
that differ by at most one row (first ranks larger); nothing is padded, so logits and loss equal
the unsplit model's.
"""

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from transformers.cache_utils import DynamicCache

from llmstack.compat.deepspeed import is_tensor_parallel
from llmstack.errors import UserError
from llmstack.models.configuration_llmstack import LLMStackConfig
from llmstack.models.loss import LossOptions
from llmstack.models.modeling_encoder import LLMStackForMaskedLM
from llmstack.models.modeling_llmstack import LLMStackForCausalLM, LLMStackPreTrainedModel
from llmstack.models.moe import ExpertShare, MoEBlock

from .cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, split_parameter
from .mappings import (
    copy_to_tensor_parallel_region,
    enter_tensor_parallel_region,
    gather_whole_sequence,
    reduce_from_tensor_parallel_region,
    shard_sizes,
    split_to_sequence_shard,
)
from .random import tensor_parallel_rng
from .topology import Topology

TrainedModel = TypeVar("TrainedModel", bound=LLMStackPreTrainedModel)

# Module name in the plain model -> dimension its weight is split along (0: output features or
# vocabulary rows, 1: input features). Parameters of other modules are replicated.
SPLIT_DIM = {
    "embed_tokens": 0,
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "o_proj": 1,
    "gate_proj": 0,
    "up_proj": 0,
    "down_proj": 1,
    "lm_head": 0,
    "experts": 0,  # gate_up_proj and down_proj: whole experts per rank
}


def split_dim(param_name: str) -> int | None:
    """Dimension along which `parallelize` splits the plain-model parameter `param_name`, or None."""
    module, kind = param_name.split(".")[-2:]
    dim = SPLIT_DIM.get(module)
    # A row-parallel layer adds its bias after the reduction: the bias is replicated.
    return None if kind == "bias" and dim == 1 else dim


def run_on_tensor_parallel_rng(module: nn.Module, draws: Callable[[nn.Module], bool]) -> None:
    """Run `module` on this rank's tensor-parallel random stream whenever it draws dropout
    (`draws(module)`): its ranks hold different heads or tokens, whose masks must differ."""
    forked = ExitStack()

    def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
        if draws(module):
            forked.enter_context(tensor_parallel_rng())

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        forked.close()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def enter_region_at_input(module: nn.Module, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
    """A sub-layer whose column-parallel projections all read its first argument enters the
    tensor-parallel region once, there (a forward pre-hook)."""

    def enter(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (enter_tensor_parallel_region(args[0], group, sequence_parallel), *args[1:])

    module.register_forward_pre_hook(enter)


@dataclass(frozen=True)
class TensorParallelExperts(ExpertShare):
    """An MoE block's share when its tensor-parallel ranks hold different whole experts.

    The ranks hold the same tokens and compute the same routing (the router is replicated); each
    runs the assignments to its own experts, and one all-reduce of the block's output (`combine`)
    sums the ranks' shares, as a row-parallel layer sums its partial products. Splitting whole
    experts rather than each expert's width keeps Mixtral's fused gate_up_proj in one piece and
    each expert's matmuls full-sized; the price is that a rank's work follows the router's load.

    Entering the region (`enter`: copy_to_tensor_parallel_region) on the expert path only sums
    the input's and the routing weights' gradients over the ranks, each of which holds the part
    from its own experts; the router's own gradient path (the auxiliary losses) is whole on every
    rank already.

    With expert parallelism too, `expert_parallelize` then splits this rank's experts over the
    expert-parallel group (so a tensor-parallel rank's experts divide by its size): the
    expert-parallel dispatch exchanges only the assignments to this tensor-parallel rank's experts,
    among the ranks of the same tensor-parallel rank. Every split is a contiguous range of
    experts, so the shards of a checkpoint concatenate, expert-parallel inside tensor-parallel.
    """

    sizes: tuple[int, ...] = ()  # every tensor-parallel rank's number of experts


def check_moe_tensor_parallel(config: LLMStackConfig, tensor_parallel_size: int, expert_parallel_size: int) -> None:
    """Raise UserError unless every tensor-parallel rank holds whole experts, and, with expert
    parallelism too, as many on every rank."""
    experts, tp, ep = config.num_local_experts, tensor_parallel_size, expert_parallel_size
    if not experts or tp == 1:
        return
    if experts < tp or (ep > 1 and experts % (tp * ep)):
        need = f"at least train.tensor_parallel_size ({tp})"
        if ep > 1:
            need = f"a multiple of train.tensor_parallel_size x train.expert_parallel_size ({tp * ep})"
        raise UserError(
            f"num_local_experts ({experts}) must be {need}: tensor parallelism gives each rank whole experts"
        )


class VocabParallelHead(ColumnParallelLinear):
    """The output layer split over the tensor-parallel group by vocabulary. Its logits are this
    rank's vocabulary slice (gather them with `gather_from_tensor_parallel_region(logits, head.group,
    head.output_sizes)`), and it computes the model's loss itself (models.loss.HeadWithLoss): from
    the sliced logits, or in training from the hidden states a chunk of tokens at a time, never
    holding the logits."""

    def loss_from_logits(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        num_items_in_batch: float | torch.Tensor | None,
        options: LossOptions,
    ) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits,
            targets,
            group=self.group,
            vocab_size=self.out_features,
            num_items_in_batch=num_items_in_batch,
            **options,
        )

    def loss_from_hidden(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        num_items_in_batch: float | torch.Tensor | None,
        options: LossOptions,
    ) -> torch.Tensor | None:
        if self.weight.dim() != 2:  # ZeRO-3 partitions the shard: go through the logits
            return None
        if not self.input_in_region:  # as ColumnParallelLinear.forward enters it
            hidden = enter_tensor_parallel_region(hidden, self.group, self.sequence_parallel)
        return vocab_parallel_linear_cross_entropy(
            hidden,
            self.weight,
            targets,
            group=self.group,
            vocab_size=self.out_features,
            num_items_in_batch=num_items_in_batch,
            **options,
        )


def _sequence_parallel_inputs(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sequence-parallel model's forward pre-hook: whole causal blocks only, and positions
    counted over the whole sequence (the body would count them on its sequence shard)."""
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    values = {**bound.arguments.get("kwargs", {}), **bound.arguments}
    _check_whole_blocks(values.get("attention_mask"), values.get("cache"), values.get("inputs_embeds"), values)
    if values.get("position_ids") is None:
        input_ids = values["input_ids"]
        bound.arguments["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    return bound.args, bound.kwargs


def _check_whole_blocks(
    attention_mask: torch.Tensor | None,
    cache: DynamicCache | None,
    inputs_embeds: torch.Tensor | None,
    kwargs: Mapping[str, Any],
) -> None:
    padded = attention_mask is not None and not bool(attention_mask.all())
    if (
        padded
        or cache is not None
        or inputs_embeds is not None
        or kwargs.get("use_cache")
        or kwargs.get("logits_to_keep")
    ):
        raise ValueError(
            "a sequence-parallel model computes whole causal blocks: no padding mask, KV cache, inputs_embeds "
            "or logits_to_keep"
        )


def check_tensor_parallel_size(config: LLMStackConfig, tensor_parallel_size: int) -> None:
    """Raise UserError unless every rank can hold whole attention heads and key/value heads."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tensor_parallel_size or kv_heads % tensor_parallel_size:
        choices = ", ".join(str(d) for d in range(1, kv_heads + 1) if kv_heads % d == 0)
        raise UserError(
            f"train.tensor_parallel_size ({tensor_parallel_size}) must divide the number of attention heads "
            f"({heads}) and of key/value heads ({kv_heads}), so that each rank computes whole heads; "
            f"possible sizes for this model: {choices}"
        )


def parallelize(model: TrainedModel, topology: Topology, sequence_parallel: bool = False) -> TrainedModel:
    """Split `model` (a plain LLMStackForCausalLM or LLMStackForMaskedLM) over `topology`'s
    tensor-parallel group, in place."""
    if type(model) not in (LLMStackForCausalLM, LLMStackForMaskedLM):
        raise TypeError(f"parallelize expects a plain LLMStackForCausalLM or LLMStackForMaskedLM, got {type(model)}")
    check_tensor_parallel_size(model.config, topology.tensor_parallel_size)
    check_moe_tensor_parallel(model.config, topology.tensor_parallel_size, topology.expert_parallel_size)
    group = topology.tensor_parallel_group
    body = model.model
    body.embed_tokens = VocabParallelEmbedding.from_embedding(body.embed_tokens, group, sequence_parallel)
    for layer in body.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _split_sublayer(attention, ("q_proj", "k_proj", "v_proj"), "o_proj", group, sequence_parallel)
        run_on_tensor_parallel_rng(attention, lambda module: bool(module.training and module.dropout))
        mlp_sequence_parallel = sequence_parallel
        if isinstance(mlp, MoEBlock):
            _split_experts(mlp, group, sequence_parallel)
            mlp, mlp_sequence_parallel = mlp.shared_experts, False  # inside the block: the whole sequence
        if mlp is not None:
            _split_sublayer(mlp, ("gate_proj", "up_proj"), "down_proj", group, mlp_sequence_parallel)
    model.lm_head = VocabParallelHead.from_linear(model.lm_head, group, sequence_parallel=sequence_parallel)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = body.embed_tokens.weight
    if sequence_parallel:
        _make_sequence_parallel(body, group)
        model.register_forward_pre_hook(_sequence_parallel_inputs, with_kwargs=True)
    return model


def _split_sublayer(
    module: nn.Module,
    column_names: Sequence[str],
    row_name: str,
    group: dist.ProcessGroup | None,
    sequence_parallel: bool,
) -> None:
    for name in column_names:
        if hasattr(module, name):
            setattr(module, name, ColumnParallelLinear.from_linear(getattr(module, name), group, input_in_region=True))
    row = RowParallelLinear.from_linear(getattr(module, row_name), group, sequence_parallel=sequence_parallel)
    setattr(module, row_name, row)
    enter_region_at_input(module, group, sequence_parallel)


def _split_experts(block: MoEBlock, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
    """Keep this rank's whole experts, a contiguous range of them (see TensorParallelExperts). With
    sequence parallelism the block gathers the whole sequence, runs as without it (every rank
    routes every token, to its own experts) and hands on its sequence shard."""
    sizes = shard_sizes(block.num_experts, dist.get_world_size(group))
    rank = dist.get_rank(group)
    for name in ("gate_up_proj", "down_proj"):
        setattr(block.experts, name, split_parameter(getattr(block.experts, name), group, dim=0))
    block.share = TensorParallelExperts(
        first=sum(sizes[:rank]),
        count=sizes[rank],
        enter=functools.partial(copy_to_tensor_parallel_region, group=group),
        combine=functools.partial(reduce_from_tensor_parallel_region, group=group),
        sizes=tuple(sizes),
    )
    if sequence_parallel:
        block.register_forward_pre_hook(lambda block, args: (gather_whole_sequence(args[0], group), *args[1:]))
        block.register_forward_hook(lambda block, args, output: split_to_sequence_shard(output, group))


def _make_sequence_parallel(body: nn.Module, group: dist.ProcessGroup | None) -> None:
    for module in body.modules():
        if type(module) is nn.Dropout:  # on a sequence shard: each rank holds other tokens
            run_on_tensor_parallel_rng(module, lambda dropout: bool(dropout.training and dropout.p))
    # An MoE block runs whole sequences (see _split_experts): its router's gradient is whole.
    in_moe_blocks = {id(p) for m in body.modules() if isinstance(m, MoEBlock) for p in m.parameters()}
    for param in body.parameters():
        if not is_tensor_parallel(param) and id(param) not in in_moe_blocks:
            param.register_hook(lambda grad: _all_reduce_copy(grad, group))


def _all_reduce_copy(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor
