"""One full state dict, under the plain llmstack model's names, from a tensor- and/or
pipeline-parallel model: the input of the Hugging Face export.

    gather_full_state_dict(module, topology)   in memory, collective over all ranks
    load_full_state_dict(checkpoint_dir, config)   offline, from a DeepSpeed checkpoint tag directory

and what a resume on another layout needs to know about each parameter (`plain_names`,
`tensor_parallel_partitions`): its plain name, and how `parallelize` split it.

Tensor-parallel shards are concatenated along the dimension `parallelize` split them
(`tensor_parallel.split_dim`); pipeline stages hold disjoint layers and are united. Data-parallel
replicas are identical, so only data-parallel rank 0 contributes.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from llmstack.compat.deepspeed import checkpoint_files, saved_tensor_parallel_size, split_pipeline_state_key
from llmstack.errors import UserError
from llmstack.models.configuration_llmstack import LLMStackConfig
from llmstack.models.moe import MoEBlock
from llmstack.safe_load import load_tensors

from .expert_parallel import gather_expert_state_dict
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import shard_sizes
from .pipeline import LLMStackPipeline, plain_name, plain_pipeline_name
from .tensor_parallel import TensorParallelExperts, split_dim
from .topology import Topology


def merge_tensor_parallel_shards(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: full tensor} from one {name: shard} dict per tensor-parallel rank, in rank order."""
    merged = {}
    for name, tensor in shards[0].items():
        dim = split_dim(name)
        merged[name] = tensor if dim is None else torch.cat([shard[name] for shard in shards], dim=dim)
    return merged


def gather_full_state_dict(module: nn.Module, topology: Topology) -> dict[str, torch.Tensor] | None:
    """The full state dict (CPU tensors) on global rank 0, None on the other ranks.

    `module`: a model (plain, `parallelize`d and/or `expert_parallelize`d) or an `LLMStackPipeline`.
    Every rank must call it. ZeRO-3 partitions are gathered first.
    """
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        if topology.expert_parallel_group is not None:  # first the experts of each tensor-parallel rank
            local = gather_expert_state_dict(module, topology.expert_parallel_group)
        else:
            local = module.state_dict()
        if isinstance(module, LLMStackPipeline):
            local = module.plain_state_dict(local)
        if topology.get_data_parallel_rank() != 0:  # another replica (data or context rank) holds the same
            return None
        local = {name: tensor.detach().cpu().clone() for name, tensor in local.items()}  # outlives the gather
    shards: list[Any] | None = (
        [None] * dist.get_world_size(topology.model_parallel_group) if dist.get_rank() == 0 else None
    )
    dist.gather_object(local, shards, dst=0, group=topology.model_parallel_group)
    if shards is None:
        return None
    # Model-parallel group ranks run pipeline stage by stage, tensor rank by tensor rank.
    tp = topology.tensor_parallel_size
    full = {}
    for stage in range(topology.pipeline_parallel_size):
        full.update(merge_tensor_parallel_shards(shards[stage * tp : (stage + 1) * tp]))
    return full


def plain_names(module: nn.Module) -> dict[str, str]:
    """{parameter name in `module`: its name in the plain model}; they differ in a pipeline only."""
    names = [name for name, _ in module.named_parameters()]
    if not isinstance(module, LLMStackPipeline):
        return {name: name for name in names}
    return {name: plain_pipeline_name(name, module.config.num_hidden_layers) for name in names}


def is_pipeline_name(name: str) -> bool:
    """Whether `name` is a PipelineModule's parameter name (`3.layer...`, `tied_modules.embed...`)."""
    prefix = name.split(".", 1)[0]
    return prefix.isdigit() or prefix == "tied_modules"


def pipeline_tied_names(module: nn.Module) -> list[str]:
    """Names of the parameters of `module` (a pipeline stage) tied across stages: the first and
    the last stage both hold (and save) the tied embedding."""
    if not isinstance(module, LLMStackPipeline):
        return []
    return [name for name, _ in module.named_parameters() if isinstance(split_pipeline_state_key(name)[0], str)]


def tensor_parallel_partitions(module: nn.Module) -> dict[str, tuple[int, list[int]]]:
    """{parameter name in `module`: (dimension `parallelize` split it along, every tensor-parallel
    rank's size along it)} for the split parameters; the others are replicated."""
    partitions = {}
    for prefix, layer in module.named_modules():
        if isinstance(layer, ColumnParallelLinear):
            split = {"weight": (0, layer.output_sizes), "bias": (0, layer.output_sizes)}
        elif isinstance(layer, RowParallelLinear):
            split = {"weight": (1, layer.input_sizes)}
        elif isinstance(layer, VocabParallelEmbedding):
            split = {"weight": (0, shard_sizes(layer.num_embeddings, dist.get_world_size(layer.group)))}
        elif isinstance(layer, MoEBlock) and isinstance(layer.share, TensorParallelExperts):  # whole experts
            experts = list(layer.share.sizes)
            split = {"gate_up_proj": (0, experts), "down_proj": (0, experts)}
            prefix, layer = f"{prefix}.experts", layer.experts
        else:
            continue
        for key, (dim, sizes) in split.items():
            if getattr(layer, key, None) is not None:
                partitions[f"{prefix}.{key}" if prefix else key] = (dim, list(sizes))
    return partitions


def load_full_state_dict(checkpoint_dir: str | Path, config: LLMStackConfig) -> dict[str, torch.Tensor]:
    """The full state dict from a DeepSpeed checkpoint tag directory (e.g. run/checkpoints/global_step100)
    saved with tensor and/or pipeline parallelism (or neither); `config` is the model's.

    Reads the module weights only (as saved: fp32, or the training dtype), never optimizer state.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise UserError(f"checkpoint directory {directory} not found")
    files = checkpoint_files(directory)
    if files.layer_states:
        shards: dict[int, dict[str, torch.Tensor]] = {}
        for (layer_index, tp_rank), path in files.layer_states.items():
            state = _load(path)
            shard = shards.setdefault(tp_rank, {})
            shard.update({plain_name(layer_index, k, config.num_hidden_layers): v for k, v in state.items()})
    else:
        if not files.model_states:
            raise UserError(
                f"{directory} holds no DeepSpeed model states (mp_rank_*_model_states.pt or layer_*-model_states.pt); "
                "pass a checkpoint tag directory such as <run>/checkpoints/global_step100"
            )
        shards = _model_states_shards(files.model_states, config)
    return merge_tensor_parallel_shards([shards[r] for r in sorted(shards)])


def _model_states_shards(
    model_states: Mapping[int, Path], config: LLMStackConfig
) -> dict[int, dict[str, torch.Tensor]]:
    """{tensor-parallel rank: its module states under the plain model's names} from one model-states
    file per model-parallel rank: a tensor-parallel rank's, or a pipeline stage's, which DeepSpeed's
    pipeline engine writes in place of layer files when the stages have MoE layers (model-parallel
    rank = stage x tensor-parallel size + tensor-parallel rank)."""
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for mp_rank, path in sorted(model_states.items()):
        state = _load(path)
        module = state["module"]
        if not any(is_pipeline_name(name) for name in module):
            shards[mp_rank] = module
            continue
        shard = shards.setdefault(mp_rank % saved_tensor_parallel_size(state), {})
        shard.update({plain_pipeline_name(name, config.num_hidden_layers): v for name, v in module.items()})
    return shards


def is_model_parallel_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Whether a DeepSpeed checkpoint tag directory was saved with tensor or pipeline parallelism
    (and so needs `load_full_state_dict` rather than DeepSpeed's zero_to_fp32)."""
    files = checkpoint_files(checkpoint_dir)
    return bool(files.layer_states) or len(files.model_states) > 1


def _load(path: Path) -> dict[str, Any]:
    return load_tensors(path)
