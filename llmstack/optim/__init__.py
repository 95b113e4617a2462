"""Optimizers and gradient compression llmstack provides itself, and their wiring into DeepSpeed."""

from .deepspeed_integration import configure_engine, gradient_compressor, initialize, resolve_optimizer
from .gradient_compression import GradientCompressor
from .onebit_adam import OneBitAdam

__all__ = [
    "GradientCompressor",
    "OneBitAdam",
    "configure_engine",
    "gradient_compressor",
    "initialize",
    "resolve_optimizer",
]
