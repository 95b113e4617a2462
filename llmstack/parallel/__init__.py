"""Tensor and pipeline parallelism for llmstack models, composed with DeepSpeed ZeRO into a 3D grid.

    topology = Topology(tensor_parallel_size=2, pipeline_parallel_size=2)   # after init_distributed
    model_parallel_seed(seed, topology)
    model = LLMStackForCausalLM(config)
    # tensor (x data) parallel, optionally sequence-parallel too:
    parallelize(model, topology, sequence_parallel=False)
    engine, *_ = deepspeed.initialize(model=model, mpu=topology, ...)
    # pipeline (x tensor x data) parallel:
    engine, *_ = deepspeed.initialize(model=to_pipeline(model, topology), ...)

Which combinations of layouts, models and features run is llmstack.parallel.layout's table.
See docs/parallelism.md for choosing the sizes. The names below are imported on first use, so
reading the layout table loads no DeepSpeed.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for type checkers
    from .checkpoint import gather_full_state_dict, is_model_parallel_checkpoint, load_full_state_dict
    from .comm_stats import CommStats
    from .cross_entropy import vocab_parallel_cross_entropy
    from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from .mappings import (
        copy_to_tensor_parallel_region,
        gather_from_sequence_parallel_region,
        gather_from_tensor_parallel_region,
        reduce_from_tensor_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        scatter_to_tensor_parallel_region,
    )
    from .pipeline import LLMStackPipeline, to_pipeline
    from .random import model_parallel_seed, tensor_parallel_rng
    from .tensor_parallel import check_tensor_parallel_size, parallelize
    from .topology import Topology

_MODULE_OF = {
    "gather_full_state_dict": "checkpoint",
    "is_model_parallel_checkpoint": "checkpoint",
    "load_full_state_dict": "checkpoint",
    "CommStats": "comm_stats",
    "vocab_parallel_cross_entropy": "cross_entropy",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "copy_to_tensor_parallel_region": "mappings",
    "gather_from_sequence_parallel_region": "mappings",
    "gather_from_tensor_parallel_region": "mappings",
    "reduce_from_tensor_parallel_region": "mappings",
    "reduce_scatter_to_sequence_parallel_region": "mappings",
    "scatter_to_tensor_parallel_region": "mappings",
    "LLMStackPipeline": "pipeline",
    "to_pipeline": "pipeline",
    "model_parallel_seed": "random",
    "tensor_parallel_rng": "random",
    "check_tensor_parallel_size": "tensor_parallel",
    "parallelize": "tensor_parallel",
    "Topology": "topology",
}
__all__ = [
    "ColumnParallelLinear",
    "CommStats",
    "LLMStackPipeline",
    "RowParallelLinear",
    "Topology",
    "VocabParallelEmbedding",
    "check_tensor_parallel_size",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_full_state_dict",
    "is_model_parallel_checkpoint",
    "load_full_state_dict",
    "model_parallel_seed",
    "parallelize",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "tensor_parallel_rng",
    "to_pipeline",
    "vocab_parallel_cross_entropy",
]


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
