"""Weights & Biases sink: one W&B run per training run, written by rank 0.

The API key comes from the environment (WANDB_API_KEY) or `wandb login`, never from the run
config. `WANDB_MODE=offline` writes the run under `<out_dir>/wandb/` without any network;
`wandb sync` uploads it later.
"""

import os
from collections.abc import Iterable, Mapping
from typing import Any

from llmstack.errors import require

from .redact import redact_secrets


class WandbSink:
    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        project: str,
        run_name: str | None = None,
        tags: Iterable[str] = (),
        run_config: Mapping[str, Any] | None = None,
        entity: str | None = None,
    ) -> None:
        self.wandb = require("wandb", "monitor")
        self.run = self.wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            tags=list(tags),
            config=redact_secrets(run_config or {}),
            dir=str(out_dir),
            settings=self.wandb.Settings(
                # Console capture would copy every printed line, and system metadata the full
                # command line, into the run: either can carry a secret passed as an override.
                console="off",
                x_disable_meta=True,
                save_code=False,
                silent=True,
            ),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() returns before wandb's service process has flushed the run file; teardown
        # waits for it, so the run is complete on disk when close() returns (and not only at
        # interpreter exit, which wandb's atexit hook does not reliably reach under launchers).
        self.wandb.teardown()
