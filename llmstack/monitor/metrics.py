"""Where training metrics go: a JSONL file that is always written, the console, and optional sinks.

A sink is any object with `log(step, metrics)` and `close()`. Only the rank that owns the logger
(rank 0) writes; the trainer reduces global values across ranks before logging them.
"""

import json
import os
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from llmstack.errors import UserError

from .console import ConsoleSink

MONITOR_KEYS = ("console", "tensorboard", "wandb", "peak_tflops")  # peak_tflops: see ThroughputMeter
WANDB_KEYS = ("project", "run_name", "tags", "entity")


class JsonlSink:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self._file.close()


class MetricsLogger:
    def __init__(
        self, out_dir: str | os.PathLike[str], enabled: bool = True, sinks: Sequence[Any] | None = None
    ) -> None:
        self.enabled = enabled
        self.sinks = []
        if enabled:
            extra = [ConsoleSink()] if sinks is None else sinks
            self.sinks = [JsonlSink(os.path.join(out_dir, "metrics.jsonl")), *extra]

    @classmethod
    def from_config(
        cls,
        monitor_cfg: Mapping[str, Any] | None,
        out_dir: str | os.PathLike[str],
        run_config: Mapping[str, Any] | None = None,
        enabled: bool = True,
        total_steps: int | None = None,
    ) -> "MetricsLogger":
        """The logger a run config's `monitor:` section asks for:

            monitor:
              console: true          # progress bar and one summary line per logging step
              tensorboard: false     # event files in OUT_DIR/tensorboard
              wandb:                 # or false/absent; `true` means project "llmstack"
                project: llmstack
                run_name: tiny-zero2
                tags: [zero2, cpu]
                entity: null
              peak_tflops: 989       # per device, for MFU; measured when absent (ThroughputMeter)

        `run_config` (secrets redacted) is logged with the run; `enabled` is False on every rank
        but 0; `total_steps` gives the progress bar its length and the ETA.
        """
        monitor_cfg = dict(monitor_cfg or {})
        _check_keys("monitor", monitor_cfg, MONITOR_KEYS)
        if not enabled:
            return cls(out_dir, enabled=False)
        os.makedirs(out_dir, exist_ok=True)  # the sinks write under it
        sinks: list[Any] = []
        if monitor_cfg.get("console", True):
            sinks.append(ConsoleSink(total_steps))
        if monitor_cfg.get("tensorboard", False):
            from .tensorboard_sink import TensorBoardSink

            sinks.append(TensorBoardSink(out_dir, run_config))
        wandb_cfg = monitor_cfg.get("wandb")
        if wandb_cfg:
            wandb_cfg = {"project": "llmstack", **({} if wandb_cfg is True else wandb_cfg)}
            if "api_key" in wandb_cfg:
                raise UserError(
                    "monitor.wandb.api_key: keep API keys out of configs; set WANDB_API_KEY or run `wandb login`"
                )
            _check_keys("monitor.wandb", wandb_cfg, WANDB_KEYS)
            from .wandb_sink import WandbSink

            sinks.append(WandbSink(out_dir, run_config=run_config, **wandb_cfg))
        return cls(out_dir, enabled=True, sinks=sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _check_keys(section: str, cfg: Mapping[str, Any], allowed: Collection[str]) -> None:
    unknown = sorted(set(cfg) - set(allowed))
    if unknown:
        raise UserError(f"unknown key(s) {', '.join(unknown)} in {section}; allowed: {', '.join(allowed)}")
