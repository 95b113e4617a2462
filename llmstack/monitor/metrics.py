"""Where training metrics go: a JSONL file that is always written, the console, and optional sinks.

A sink is any object with `log(step, metrics)` and `close()`. Only the rank that owns the logger
(rank 0) writes; the trainer reduces global values across ranks before logging them.
"""

import json
import os
import time


class JsonlSink:
    def __init__(self, path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def log(self, step, metrics):
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self):
        self._file.close()


class ConsoleSink:
    def log(self, step, metrics):
        print(f"step {step:>6} | " + " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()), flush=True)

    def close(self):
        pass


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class MetricsLogger:
    def __init__(self, out_dir, enabled=True, sinks=None):
        self.enabled = enabled
        self.sinks = [JsonlSink(os.path.join(out_dir, "metrics.jsonl")), *(sinks or [ConsoleSink()])] if enabled else []

    def log(self, step, metrics):
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self):
        for sink in self.sinks:
            sink.close()
