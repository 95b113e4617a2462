"""train.compile: each decoder block through torch.compile (inductor), in place.

On CPUs the time of a step of a small model goes largely to elementwise work between the matmuls
(RMSNorm, rotary, SiLU-gating, residual adds and their backward), each a pass over memory;
inductor fuses them into a few loops. Blocks are compiled one by one rather than the whole model:
every block has the same code and shapes, so one compilation serves them all, and what surrounds
the blocks (activation checkpointing, DeepSpeed's ZeRO-3 parameter hooks) stays eager.
Compilation happens on the first step (tens of seconds on a few CPU cores), so it pays on runs of
more than a few hundred steps.
"""

from torch import nn

from llmstack.errors import UserError
from llmstack.models.modeling_llmstack import DecoderLayer

from .config import TrainConfig


def check_compile_supported(cfg: TrainConfig) -> None:
    """train.compile compiles the blocks of a plain (data-parallel) model only."""
    if cfg.compile and (cfg.tensor_parallel_size > 1 or cfg.pipeline_parallel_size > 1):
        raise UserError(
            "train.compile works with data parallelism (any ZeRO stage) only, not with tensor or pipeline "
            "parallelism: set train.compile=false or train.tensor_parallel_size=1 and train.pipeline_parallel_size=1"
        )


def compile_decoder_layers(model: nn.Module) -> int:
    """torch.compile each DecoderLayer of `model` (plain or wrapped, e.g. by peft) in place; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
