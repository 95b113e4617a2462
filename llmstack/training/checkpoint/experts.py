"""The experts of an expert-parallel run in its checkpoints: one file per expert-parallel rank.

DeepSpeed writes the model-states file on data-parallel rank 0 alone, which holds only that rank's
share of the experts (llmstack's MoE blocks are not DeepSpeed's MoE class, whose per-expert files
its engine writes). So each expert-parallel rank's experts are saved beside it, by the first of
the ranks holding them (expert-data-parallel rank 0):

    experts_ep_rank{R}.pt              {parameter name: this rank's experts}, as the model computes with them
    experts_tp_rank{T}_ep_rank{R}.pt   the same with tensor parallelism: tensor-parallel rank T's
                                       experts split over the expert-parallel ranks
    experts_pp_rank{P}_ep_rank{R}.pt   the same with pipeline parallelism: stage P's MoE layers
                                       (experts_pp_rank{P}_tp_rank{T}_ep_rank{R}.pt with both)

The files name parameters as the plain model does (not a pipeline stage's numbered layers), so
the stages' files together hold every MoE layer. Resuming, each rank loads its file after
DeepSpeed's own load; export concatenates each parameter's shards in rank order, expert-parallel
ranks inside tensor-parallel ones, into the whole model's experts (llmstack.parallel.tensor_parallel
and .expert_parallel keep contiguous ranges of experts).
"""

import os
import re
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from llmstack.compat.deepspeed import is_zero3_partitioned
from llmstack.parallel import Topology
from llmstack.parallel.checkpoint import plain_names
from llmstack.parallel.expert_parallel import is_expert_parameter
from llmstack.safe_load import load_tensors

EXPERTS_FILE_NAME = re.compile(r"experts(?:_pp_rank(\d+))?(?:_tp_rank(\d+))?_ep_rank(\d+)\.pt")


@dataclass
class ExpertShard:
    """This rank's share of a model whose experts are split over `size` ranks."""

    size: int
    rank: int  # in the expert-parallel group: which experts this rank holds
    writer: bool  # whether this rank saves them (the first of the ranks holding the same experts)
    tensor_parallel_rank: int | None = None  # with tensor parallelism: whose experts this rank splits
    pipeline_rank: int | None = None  # with pipeline parallelism: the stage whose MoE layers this rank holds

    @classmethod
    def of(cls, topology: Topology) -> "ExpertShard | None":
        """This rank's share under `topology`; None when the experts are not split."""
        if topology.expert_parallel_group is None:
            return None
        return cls(
            topology.expert_parallel_size,
            dist.get_rank(topology.expert_parallel_group),
            dist.get_rank(topology.expert_data_parallel_group) == 0,
            topology.tensor_parallel_rank if topology.tensor_parallel_size > 1 else None,
            topology.pipeline_parallel_rank if topology.pipeline_parallel_size > 1 else None,
        )

    @property
    def file_name(self) -> str:
        stage = "" if self.pipeline_rank is None else f"_pp_rank{self.pipeline_rank}"
        tensor = "" if self.tensor_parallel_rank is None else f"_tp_rank{self.tensor_parallel_rank}"
        return f"experts{stage}{tensor}_ep_rank{self.rank}.pt"


def local_experts(model: nn.Module) -> dict[str, torch.Tensor]:
    """{plain model's name: tensor} of the expert parameters `model` (or a pipeline stage) holds
    (a copy on the CPU). Collective over the expert-data-parallel group under ZeRO-3, which
    partitions each rank's experts over it."""
    params = _expert_parameters(model)
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().cpu().clone() for name, p in params.items()}


@torch.no_grad()
def load_local_experts(model: nn.Module, path: str) -> None:
    """Copy the experts saved in `path` into `model`'s expert parameters (same names and shapes).
    Nothing to do under ZeRO-3: DeepSpeed saves its partitions on every data-parallel rank, this
    rank's experts among them, and its load has restored them."""
    params = _expert_parameters(model)
    if any(is_zero3_partitioned(p) for p in params.values()):
        return
    saved = load_tensors(path)
    if set(saved) != set(params):
        raise ValueError(f"{path} holds experts {sorted(saved)}, the model {sorted(params)}")
    for name, param in params.items():
        param.copy_(saved[name])


def _expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{plain model's name: parameter} of `model`'s experts."""
    plain = plain_names(model)
    return {plain[name]: p for name, p in model.named_parameters() if is_expert_parameter(p)}


def saved_expert_parallel_size(tag_dir: str) -> int:
    """The expert-parallel size that saved checkpoint `tag_dir` (1: experts not split)."""
    return len({ep for *_, ep in _expert_files(tag_dir)}) or 1


def merged_experts(tag_dir: str) -> dict[str, torch.Tensor]:
    """{name: every expert} from the expert files of checkpoint `tag_dir` ({} when it has none):
    each parameter's shards (one stage's files hold it) concatenated in rank order."""
    shards: dict[str, list[torch.Tensor]] = {}
    for path in _expert_files(tag_dir).values():
        for name, tensor in load_tensors(path).items():
            shards.setdefault(name, []).append(tensor)
    return {name: torch.cat(parts) for name, parts in shards.items()}


def _expert_files(tag_dir: str) -> dict[tuple[int, int, int], str]:
    """{(stage, tensor-parallel rank, expert-parallel rank): path} of the expert files of `tag_dir`, in that order."""
    files = {}
    for name in os.listdir(tag_dir):
        if match := EXPERTS_FILE_NAME.fullmatch(name):
            files[int(match[1] or 0), int(match[2] or 0), int(match[3])] = os.path.join(tag_dir, name)
    return dict(sorted(files.items()))
