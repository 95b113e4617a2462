"""train.compile: each decoder block through torch.compile (inductor), in place.

On CPUs the time of a step of a small model goes largely to elementwise work between the matmuls
(RMSNorm, rotary, SiLU-gating, residual adds and their backward), each a pass over memory;
inductor fuses them into a few loops. Blocks are compiled one by one rather than the whole model:
every block has the same code and shapes, so one compilation serves them all, and what surrounds
the blocks (activation checkpointing, DeepSpeed's ZeRO-3 parameter hooks) stays eager.
In a tensor-parallel model the blocks' collectives (autograd functions around all-reduces) split
the compiled graphs; a pipeline compiles the blocks of its stages.

Compilation happens on the first step (11-16 s for the bench and quickstart models on 2 CPU
cores with an empty cache, less when inductor's cache has the graphs), so `train.compile: auto`, the default, compiles
runs of at least AUTO_MIN_STEPS steps only (README, "Compiled steps"). A backend that cannot
compile (no C++ compiler, a broken toolchain) leaves the blocks eager, with one warning.
"""

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmstack.models.modeling_llmstack import DecoderLayer

logger = logging.getLogger(__name__)

COMPILE_SETTINGS = (True, False, "auto")
# `auto` compiles runs of at least this many optimizer steps. bench/bench_compile.py, empty compile
# cache, 2 CPU cores: bench_train's 13.8M model compiles in 15-16 s and then saves 0.11-0.14 s a
# step (break-even after 118-135 steps); the quickstart's 4M model compiles in 11 s and saves
# 0.02 s (break-even after about 500). The threshold is twice the smaller model's break-even.
AUTO_MIN_STEPS = 1000

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]


def compile_wanted(setting: bool | str, max_steps: int) -> bool:
    """Whether a run of `max_steps` steps compiles under `train.compile: setting`."""
    return max_steps >= AUTO_MIN_STEPS if setting == "auto" else bool(setting)


class EagerFallback:
    """A torch.compile backend that compiles with `backend` (inductor by default) and, the first
    time that fails, warns once and from then on runs every graph as traced, uncompiled: the
    same operations as eager, so training goes on with the same numbers."""

    def __init__(self, backend: Backend | None = None) -> None:
        self.backend: Backend = backend or torch._dynamo.lookup_backend("inductor")
        self.failure: Exception | None = None

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.failure is None:
            try:
                return self.backend(graph, example_inputs)
            except Exception as e:  # whatever the toolchain raises; the graph still runs eagerly
                self.failure = e
                first_line = (str(e).strip().splitlines() or [""])[0]
                logger.warning(
                    "torch.compile failed (%s: %s); the decoder blocks run eager. Set train.compile: "
                    "false to skip compilation.",
                    type(e).__name__,
                    first_line,
                )
        return graph.forward


def compile_decoder_layers(model: nn.Module, backend: Backend | None = None) -> int:
    """torch.compile each DecoderLayer of `model` (plain or wrapped, e.g. by peft) in place,
    falling back to eager if `backend` (default inductor) fails; returns how many were compiled."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    fallback = EagerFallback(backend)
    for layer in layers:
        layer.compile(backend=fallback)
    return len(layers)
