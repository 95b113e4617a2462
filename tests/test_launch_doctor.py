import importlib.metadata
import subprocess
import sys

import torch


def doctor(*python_prelude):
    """`llmstack doctor` in a fresh interpreter, after running the given statements."""
    code = "; ".join([*python_prelude, "from llmstack.cli.main import main", "sys.exit(main(['doctor']))"])
    command = [sys.executable, "-c", "import sys; " + code]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)  # a hang guard (it times a probe)


def rows(output):
    """{name: value} of the report's indented lines (names and values are separated by 2+ spaces)."""
    pairs = [line.strip().split("  ", 1) for line in output.splitlines() if line.startswith("  ")]
    return {name: value.strip() for name, value in pairs}


def test_doctor_reports_versions_accelerator_backend_ops_and_resources():
    result = doctor()
    assert result.returncode == 0, result.stderr
    for section in ("Versions", "CUDA", "DeepSpeed", "Resources"):
        assert f"\n{section}\n" in f"\n{result.stdout}"
    report = rows(result.stdout)
    for package in ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "accelerate"):
        assert report[package] == importlib.metadata.version(package)
    from deepspeed.accelerator import get_accelerator

    assert report["accelerator"] == get_accelerator().device_name()
    assert report["comm backend"] == get_accelerator().communication_backend_name()
    assert report["available"].startswith("yes" if torch.cuda.is_available() else "no")
    assert "cpu_adam" in report["ops buildable"] + report["ops not buildable"]
    assert "GiB free of" in report["memory"] and "GiB free of" in report["/dev/shm"]


def test_doctor_reports_a_missing_library_instead_of_crashing():
    result = doctor("sys.modules['deepspeed'] = None", "sys.modules['psutil'] = None")
    assert result.returncode == 0, result.stderr
    report = rows(result.stdout)
    assert report["torch"] == importlib.metadata.version("torch")
    assert report["error"].startswith("unavailable (ModuleNotFoundError")
    assert result.stdout.count("unavailable (ModuleNotFoundError") == 2  # DeepSpeed and Resources sections
