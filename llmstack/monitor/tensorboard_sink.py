"""TensorBoard sink: scalar event files under `<out_dir>/tensorboard/` (`tensorboard --logdir`)."""

import json
import os
from collections.abc import Mapping
from typing import Any

from llmstack.errors import require

from .redact import redact_secrets


class TensorBoardSink:
    def __init__(self, out_dir: str | os.PathLike[str], run_config: Mapping[str, Any] | None = None) -> None:
        require("tensorboard", "monitor")  # torch.utils.tensorboard needs the tensorboard package
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))
        if run_config:
            config = json.dumps(redact_secrets(run_config), indent=2, default=str)
            # Four leading spaces make TensorBoard's markdown text view show it as code.
            self.writer.add_text("config", "\n".join("    " + line for line in config.splitlines()), 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
