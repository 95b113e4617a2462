"""Tensor-parallel layers (Megatron-LM's column / row / vocabulary splits).

A transformer block pairs them so that only one all-reduce per sub-layer is needed in each
direction: a `ColumnParallelLinear` splits its output features (attention heads, MLP columns),
each rank computes on its own slice, and the following `RowParallelLinear` splits its input
features the same way and sums the partial products across ranks.

Each layer returns a plain tensor, like `nn.Linear` / `nn.Embedding`, so it replaces them inside an
unchanged model. `from_linear` / `from_embedding` split an existing full layer, so a tensor-parallel
model starts from exactly the weights of the unsplit one. Split parameters are marked
tensor-parallel (`mark_tensor_parallel`), which DeepSpeed reads when it sums gradient norms over the
model-parallel group.

Entering the region costs an all-reduce of the input's gradient in the backward pass. Where
several column-parallel projections read the same input (q, k and v; gate and up), the caller
enters the region once (`enter_tensor_parallel_region`) and builds them with
`input_in_region=True`, as Megatron-LM does by fusing them into one matrix.

With `sequence_parallel=True` the activations outside the region are split along the sequence
rather than replicated: the region is entered with an all-gather and left with a reduce-scatter
(together the bytes of one all-reduce), and norms and dropout there process 1/tp of the tokens.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmstack.compat.deepspeed import mark_tensor_parallel

from .mappings import (
    enter_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    leave_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
    shard_sizes,
)


def split_parameter(full: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> nn.Parameter:
    """This rank's slice of `full` along `dim`, as a new parameter marked tensor-parallel."""
    sizes = shard_sizes(full.shape[dim], dist.get_world_size(group))
    shard = full.detach().split(sizes, dim=dim)[dist.get_rank(group)].clone()
    param = nn.Parameter(shard, requires_grad=full.requires_grad)
    mark_tensor_parallel(param)
    return param


def _init_like_linear(weight: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default init for the full layer (uniform, bound 1/sqrt(fan_in)) on this shard."""
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W and b split by output feature; the output stays split unless
    `gather_output`. `input_in_region`: the caller has already entered the region with x
    (`enter_tensor_parallel_region`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None,
        bias: bool = False,
        gather_output: bool = False,
        input_in_region: bool = False,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.input_in_region = group, gather_output, input_in_region
        self.sequence_parallel = sequence_parallel
        self.output_sizes = shard_sizes(out_features, dist.get_world_size(group))
        local = self.output_sizes[dist.get_rank(group)]
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device))
        self.bias = nn.Parameter(torch.zeros(local, device=device)) if bias else None
        _init_like_linear(self.weight, in_features)
        for param in self.parameters():
            mark_tensor_parallel(param)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: dist.ProcessGroup | None,
        gather_output: bool = False,
        input_in_region: bool = False,
        sequence_parallel: bool = False,
    ) -> "ColumnParallelLinear":
        layer = cls(
            linear.in_features,
            linear.out_features,
            group,
            bias=linear.bias is not None,
            gather_output=gather_output,
            input_in_region=input_in_region,
            sequence_parallel=sequence_parallel,
            device="meta",
        )
        layer.weight = split_parameter(linear.weight, group, dim=0)
        if linear.bias is not None:
            layer.bias = split_parameter(linear.bias, group, dim=0)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_tensor_parallel_region(x, self.group, self.sequence_parallel)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.group, self.output_sizes)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (this rank: {self.weight.shape[0]}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: W split by input feature, x split the same way
    (already, when `input_is_parallel`, as a `ColumnParallelLinear` leaves it)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None,
        bias: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.input_sizes = shard_sizes(in_features, dist.get_world_size(group))
        local = self.input_sizes[dist.get_rank(group)]
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device))
        mark_tensor_parallel(self.weight)
        # The bias is added once, after the reduction, so it is replicated rather than split.
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        _init_like_linear(self.weight, in_features)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: dist.ProcessGroup | None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> "RowParallelLinear":
        layer = cls(
            linear.in_features,
            linear.out_features,
            group,
            bias=linear.bias is not None,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            device="meta",
        )
        layer.weight = split_parameter(linear.weight, group, dim=1)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group, self.input_sizes)
        y = leave_tensor_parallel_region(F.linear(x, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary row: each rank looks up the tokens in its row range,
    contributes zeros for the others, and the partial results are summed across ranks."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel = sequence_parallel
        sizes = shard_sizes(num_embeddings, dist.get_world_size(group))
        rank = dist.get_rank(group)
        self.vocab_start = sum(sizes[:rank])
        self.vocab_end = self.vocab_start + sizes[rank]
        self.weight = nn.Parameter(torch.empty(sizes[rank], embedding_dim, device=device))
        mark_tensor_parallel(self.weight)
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: dist.ProcessGroup | None, sequence_parallel: bool = False
    ) -> "VocabParallelEmbedding":
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel, device="meta")
        layer.weight = split_parameter(embedding.weight, group, dim=0)
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tensor_parallel_region(y, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, this rank: rows {self.vocab_start}-{self.vocab_end - 1}"
