"""Optimizers llmstack provides itself, and their wiring into DeepSpeed."""

from .deepspeed_integration import configure_engine, initialize, resolve_optimizer
from .onebit_adam import OneBitAdam

__all__ = ["OneBitAdam", "configure_engine", "initialize", "resolve_optimizer"]
