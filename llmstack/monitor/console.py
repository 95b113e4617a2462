"""Console sink: a tqdm progress bar with ETA and one readable line per logging step.

    step  200/1000 | loss 3.4121 | acc 38.5% | lr 3.00e-04 | grad 0.84 | 12.3k tok/s | MFU 38.2% | eta 14:21

FLOP/s take the unit that shows them (812 GFLOP/s on a CPU); an MFU the meter could not trust
(NaN, see ThroughputMeter) reads "MFU n/a".
The bar is drawn only on a terminal (tqdm's default); the summary lines are printed either way,
so log files of launched runs stay readable.
"""

import math
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from tqdm import tqdm

from .throughput import format_flops

# metric name -> (label, format) for the summary line, in display order. Metrics not listed
# here still reach every other sink.
SUMMARY_FIELDS = {
    "loss": ("loss", "{:.4f}"),
    "accuracy": ("acc", "{:.1%}"),
    "span_accuracy": ("span acc", "{:.1%}"),
    "val_loss": ("val loss", "{:.4f}"),
    "val_accuracy": ("val acc", "{:.1%}"),
    "val_span_accuracy": ("val span acc", "{:.1%}"),
    "val_ppl": ("val ppl", "{:.2f}"),
    "lr": ("lr", "{:.2e}"),
    "grad_norm": ("grad", "{:.2f}"),
    "loss_scale": ("scale", "{:g}"),
    "skipped_steps": ("skipped", "{:.0f}"),
    "tokens_per_s": ("", "{} tok/s"),
    "tflops": ("", "{}"),
    "mfu": ("MFU", "{:.1%}"),
    "step_time_s": ("", "{:.2f} s/step"),
    "memory_gb": ("mem", "{:.1f}G"),
}


class ConsoleSink:
    def __init__(self, total_steps: int | None = None, file: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.file = file or sys.stderr
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=self.file, disable=None)
        self.start: tuple[float, int] | None = None  # (time, step) of the first log, the origin of the ETA

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = (now, step)
        if not self.bar.disable:
            self.bar.update(step - self.bar.n)
        line = format_summary(step, metrics, self.total_steps, self.eta(now, step))
        if self.bar.disable:
            print(line, file=self.file, flush=True)
        else:
            self.bar.write(line, file=self.file)

    def eta(self, now: float, step: int) -> float | None:
        """Seconds left at the mean step time since the first log, or None before it is known."""
        if self.start is None:
            return None
        start_time, start_step = self.start
        if not self.total_steps or step <= start_step:
            return None
        return (now - start_time) / (step - start_step) * max(self.total_steps - step, 0)

    def close(self) -> None:
        self.bar.close()


def format_summary(
    step: int, metrics: Mapping[str, float], total_steps: int | None = None, eta_seconds: float | None = None
) -> str:
    width = len(str(total_steps)) if total_steps else 0
    parts = [f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"]
    for name, (label, fmt) in SUMMARY_FIELDS.items():
        value = metrics.get(name)
        if name == "mfu" and isinstance(value, float) and math.isnan(value):
            parts.append("MFU n/a")
            continue
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        text = fmt.format(_FORMATTERS[name](value)) if name in _FORMATTERS else fmt.format(value)
        parts.append(f"{label} {text}" if label else text)
    parts += _task_parts(metrics)
    if eta_seconds is not None:
        parts.append(f"eta {tqdm.format_interval(eta_seconds)}")
    return " | ".join(parts)


def _task_parts(metrics: Mapping[str, float]) -> list[str]:
    """A multi-task run's `task/NAME/{loss,weight,accuracy}` metrics, one part a task:
    "NAME 0.6931 w 1.00 acc 50.0%"."""
    names = dict.fromkeys(key.split("/")[1] for key in metrics if key.startswith("task/") and key.count("/") == 2)
    parts = []
    for name in names:
        loss, weight, accuracy = (metrics.get(f"task/{name}/{m}") for m in ("loss", "weight", "accuracy"))
        text = name + (f" {loss:.4f}" if loss is not None else "") + (f" w {weight:.2f}" if weight is not None else "")
        parts.append(text + (f" acc {accuracy:.1%}" if accuracy is not None else ""))
    return parts


def _tflops(value: float) -> str:
    return format_flops(value * 1e12)


def _si(value: float) -> str:
    """1234567 -> '1.23M': throughput at a glance."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


_FORMATTERS = {"tokens_per_s": _si, "tflops": _tflops}
