"""Optimizers llmstack provides itself, and their wiring into DeepSpeed."""

from .deepspeed_integration import configure_engine, resolve_optimizer
from .onebit_adam import OneBitAdam

__all__ = ["OneBitAdam", "configure_engine", "resolve_optimizer"]
