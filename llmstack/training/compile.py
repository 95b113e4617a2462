"""train.compile: each decoder block through torch.compile (inductor), in place.

On CPUs the time of a step of a small model goes largely to elementwise work between the matmuls
(RMSNorm, rotary, SiLU-gating, residual adds and their backward), each a pass over memory;
inductor fuses them into a few loops. Blocks are compiled one by one rather than the whole model:
every block has the same code and shapes, so one compilation serves them all, and what surrounds
the blocks (activation checkpointing, DeepSpeed's ZeRO-3 parameter hooks) stays eager.
Compilation happens on the first step (tens of seconds on a few CPU cores), so it pays on runs of
more than a few hundred steps. In a tensor-parallel model the blocks' collectives (autograd
functions around all-reduces) split the compiled graphs; a pipeline compiles the blocks of its stages.
"""

from torch import nn

from llmstack.models.modeling_llmstack import DecoderLayer


def compile_decoder_layers(model: nn.Module) -> int:
    """torch.compile each DecoderLayer of `model` (plain or wrapped, e.g. by peft) in place; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
