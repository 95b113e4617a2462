"""Optimizers, gradient compression and overlapped gradient reduction llmstack provides itself,
and their wiring into DeepSpeed."""

from .burst_adamw import BurstAdamW
from .deepspeed_integration import (
    configure_engine,
    gradient_compressor,
    initialize,
    optimizer_state_gathered,
    overlapped_reduction,
    resolve_optimizer,
)
from .gradient_compression import GradientCompressor
from .onebit_adam import OneBitAdam
from .overlapped_reduction import OverlappedReduction

__all__ = [
    "BurstAdamW",
    "GradientCompressor",
    "OneBitAdam",
    "OverlappedReduction",
    "configure_engine",
    "gradient_compressor",
    "initialize",
    "optimizer_state_gathered",
    "overlapped_reduction",
    "resolve_optimizer",
]
