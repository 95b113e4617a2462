"""Errors a user can cause. The CLI prints their message, without a traceback, and exits 2."""

import importlib
from types import ModuleType


class UserError(Exception):
    """A mistake in a config, a path, the data or the launch that the user can fix.

    The message says what is wrong and what to do about it.
    """


def require(module: str, extra: str) -> ModuleType:
    """Import the optional dependency `module`, or stop with the one `pip install` line that adds it.

    Optional parts of llmstack (language ID, W&B, plots, LoRA, serving) live in extras, so a
    pretraining image need not carry them; this is how a missing one is reported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name != module and not module.startswith(e.name + "."):
            raise  # the package is there but something it needs is broken: show the real error
        raise UserError(f"{module} is not installed: pip install 'llmstack[{extra}]'") from None
