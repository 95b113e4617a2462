from .config import RunConfig, load_run_config
from .trainer import Trainer

__all__ = ["RunConfig", "Trainer", "load_run_config"]
