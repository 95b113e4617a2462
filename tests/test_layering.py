"""The architecture the folders show: which llmstack package may import which, no cycles, and a
light `import llmstack` / `llmstack --help`."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmstack"
HEAVY = ("transformers", "deepspeed", "peft", "matplotlib", "torch")

# package -> llmstack packages it must not import (directly or through a chain).
FORBIDDEN = {
    "models": {"training", "parallel", "data", "inference", "monitor", "optim", "cli"},
    "data": {"models", "training", "parallel", "inference", "optim", "cli"},
    "inference": {"training", "parallel", "optim", "cli"},
    "parallel": {"training", "inference", "cli"},
    "monitor": {"training", "inference", "cli"},
    "hparams": {"inference", "cli"},  # sweeps start `llmstack train` as a subprocess, never the CLI in-process
}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "llmstack" else None


def imports_by_package() -> dict[str, set[str]]:
    """{llmstack package: llmstack packages its modules import}, from the source (also lazy imports)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[:-1]  # the package a relative import starts from (for __init__ too)
        own = package_of(".".join(package + ["x"]))
        if own is None or len(package) < 2:  # llmstack/*.py: shared helpers (errors, net, safe_load)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                names = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = package_of(name)
                if target and target != own:
                    graph.setdefault(own, set()).add(target)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package):
    graph = imports_by_package()
    assert not reachable(graph, package) & FORBIDDEN[package]


def test_no_import_cycle_among_packages():
    graph = imports_by_package()
    cycles = [p for p in graph if p in reachable(graph, p)]
    assert not cycles, f"import cycles through {cycles}: {graph}"


@pytest.mark.parametrize("command", ["import llmstack", "from llmstack.cli.main import main; main(['--help'])"])
def test_import_and_help_load_no_heavy_library(command):
    """`python -X importtime` lists every module imported; none of the heavy libraries may be among them."""
    script = f"import sys\ntry:\n    {command}\nexcept SystemExit:\n    pass\n"
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", script], capture_output=True, text=True)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "llmstack" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
