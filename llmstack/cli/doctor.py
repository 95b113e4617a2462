"""`llmstack doctor`: what this machine offers a training run; the first command to run on a new cluster.

Every probe is isolated: a missing library or a failing driver shows up as one line of the report
instead of ending it.
"""

import importlib.metadata
import os
import platform
import shutil
from argparse import ArgumentParser, Namespace
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
PACKAGES = ("llmstack", "torch", "deepspeed", "transformers", "datasets", "tokenizers", "accelerate", "wandb")


def add_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--path", default=".", help="where checkpoints will go, for the free disk space (default: .)")
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="print the table of supported layout combinations (and why the others are refused) instead",
    )


def run(args: Namespace) -> None:
    if args.layouts:
        from llmstack.parallel.layout import format_table

        print(format_table())
        return
    sections = {
        "Versions": probe_rows(versions),
        "CUDA": probe_rows(cuda),
        "CPU": probe_rows(cpu),
        "DeepSpeed": probe_rows(deepspeed_report),
        "Resources": probe_rows(resources, args.path),
    }
    width = max(len(name) for rows in sections.values() for name in rows)
    for title, rows in sections.items():
        print(title)
        for name, value in rows.items():
            print(f"  {name:<{width}}  {value}")


def probe(fn: Callable[..., T], *args: Any) -> T | str:
    """fn(*args), or a one-line reason why it could not say."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (a report of what is broken must not break)
        first_line = str(e).splitlines()[0] if str(e) else ""
        return f"unavailable ({type(e).__name__}: {first_line})"


def probe_rows(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """fn(*args) -> {name: value}, or one "error" row."""
    rows = probe(fn, *args)
    return rows if isinstance(rows, dict) else {"error": rows}


def versions() -> dict[str, str]:
    rows = {"python": platform.python_version()}
    for name in PACKAGES:
        rows[name] = probe(importlib.metadata.version, name)
    return rows


def cuda() -> dict[str, str | None]:
    import torch

    if not torch.cuda.is_available():
        return {"available": f"no (torch built with CUDA {torch.version.cuda})" if torch.version.cuda else "no"}
    rows = {
        "available": f"yes, {torch.cuda.device_count()} device(s)",
        "torch CUDA": torch.version.cuda,
        "NCCL": probe(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
    }
    for i in range(torch.cuda.device_count()):
        rows[f"device {i}"] = probe(_cuda_device, i)
    return rows


def cpu() -> dict[str, str]:
    """The CPU model, torch's threads, and whether bf16 runs natively (flags and a timed probe)."""
    import torch

    from llmstack.monitor.peak_flops import cpu_model
    from llmstack.training.cpu_bf16 import cpu_bf16_report

    report = cpu_bf16_report(probe=True)
    advice = "" if report.native else "; train in fp32 (ds_configs/zero2.json)"
    return {"model": cpu_model(), "torch threads": str(torch.get_num_threads()), "bf16": report.describe() + advice}


def _cuda_device(index: int) -> str:
    import torch

    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return f"{props.name}, compute {props.major}.{props.minor}, {_gib(free)} free of {_gib(total)}"


def deepspeed_report() -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    rows = {
        "supported by llmstack": probe(_supported),
        "accelerator": probe(accelerator.device_name),
        "comm backend": probe(accelerator.communication_backend_name),
        "ninja (JIT ops)": probe(lambda: "yes" if _ninja() else "no: pip install ninja to JIT-build ops"),
    }
    rows.update(probe_rows(_ops))
    return rows


def _ninja() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available()


def _supported() -> str:
    """ "yes", or (raised) why llmstack refuses the installed DeepSpeed or transformers."""
    from llmstack.compat.deepspeed import check_installed as check_deepspeed
    from llmstack.compat.transformers import check_installed as check_transformers

    check_deepspeed()
    check_transformers()
    return "yes"


def _ops() -> dict[str, str]:
    """Which DeepSpeed ops are prebuilt and which this machine can JIT-build."""
    from llmstack.compat.deepspeed import op_report

    ops = op_report()
    return {
        "ops prebuilt": ", ".join(ops["prebuilt"]) or "none (JIT-built on first use)",
        "ops buildable": ", ".join(ops["buildable"]) or "none",
        "ops not buildable": ", ".join(ops["not buildable"]) or "none",
    }


def resources(path: str) -> dict[str, str]:
    import psutil

    memory = psutil.virtual_memory()
    return {
        "CPU cores": f"{os.cpu_count()} logical",
        "memory": f"{_gib(memory.available)} free of {_gib(memory.total)}",
        f"disk at {os.path.abspath(path)}": probe(_disk, path),
        "/dev/shm": probe(_disk, "/dev/shm"),
    }


def _disk(path: str) -> str:
    usage = shutil.disk_usage(path)
    return f"{_gib(usage.free)} free of {_gib(usage.total)}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
