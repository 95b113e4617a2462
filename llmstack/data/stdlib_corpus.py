"""The quickstart's corpus: English prose from the docstrings of the Python standard library.

Every Python installation carries it (about 1.3 MB of docstrings over 200 characters), so the
quickstart needs no download. Documents are split into train and validation by a hash of their
text, so the split is the same on every machine with the same Python.
"""

import ast
import hashlib
import inspect
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


def stdlib_source_files() -> Iterator[str]:
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def docstrings(path: str, min_chars: int) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and len(doc) >= min_chars:
                yield inspect.cleandoc(doc)


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """Every distinct stdlib docstring of at least min_chars characters, in a fixed order."""
    return list(dict.fromkeys(doc for path in stdlib_source_files() for doc in docstrings(path, min_chars)))


def write_stdlib_corpus(
    out_dir: str | Path, min_chars: int = 200, valid_fraction: float = 0.05
) -> dict[str, tuple[int, ...]]:
    """Write `train.jsonl` and `valid.jsonl` under out_dir; returns {split: (documents, bytes)}."""
    os.makedirs(out_dir, exist_ok=True)
    root = sysconfig.get_paths()["stdlib"]
    seen, stats = set(), {"train": [0, 0], "valid": [0, 0]}
    files = list(stdlib_source_files())
    with (
        open(os.path.join(out_dir, "train.jsonl"), "w") as train,
        open(os.path.join(out_dir, "valid.jsonl"), "w") as valid,
    ):
        for path in tqdm(files, desc="stdlib corpus", unit="file", disable=None):
            source = os.path.relpath(path, root)
            for doc in docstrings(path, min_chars):
                digest = hashlib.sha1(doc.encode()).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                split = "valid" if int(digest[:8], 16) / 0xFFFFFFFF < valid_fraction else "train"
                line = json.dumps({"id": digest[:16], "source": source, "text": doc})
                (valid if split == "valid" else train).write(line + "\n")
                stats[split][0] += 1
                stats[split][1] += len(doc.encode())
    return {k: tuple(v) for k, v in stats.items()}
