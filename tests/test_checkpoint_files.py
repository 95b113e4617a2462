"""Checkpoint files without a training run: manifest checks, failed writes, safe loading,
retention, RNG states, and the refusal of unverifiable checkpoints."""

import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmstack.errors import UserError
from llmstack.safe_load import load_tensors, safe_loading
from llmstack.training.checkpoint.engine import ManifestCheckpointEngine
from llmstack.training.checkpoint.files import (
    NO_MANIFEST,
    CorruptManifest,
    crc32_of,
    file_problems,
    read_manifest,
    write_file,
    write_manifest,
)
from llmstack.training.checkpoint.manager import tags_to_keep
from llmstack.training.export import check_checkpoint
from llmstack.training.rng import rng_state, set_rng_state


def make_checkpoint(directory, sizes=(1000, 2000, 3000)):
    os.makedirs(directory, exist_ok=True)
    files = {}
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        files[f"shard{i}.pt"] = write_file(os.path.join(directory, f"shard{i}.pt"), lambda f, d=data: f.write(d))
    write_manifest(directory, files)
    return files


def test_manifest_records_sizes_and_checksums_and_finds_damage(tmp_path):
    files = make_checkpoint(tmp_path)
    assert read_manifest(tmp_path) == files
    assert files["shard1.pt"] == {"bytes": 2000, "crc32": crc32_of(tmp_path / "shard1.pt")}
    assert file_problems(tmp_path, files) == []

    with open(tmp_path / "shard0.pt", "r+b") as f:  # truncated
        f.truncate(500)
    with open(tmp_path / "shard1.pt", "r+b") as f:  # one byte flipped, same size
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 1]))
    os.remove(tmp_path / "shard2.pt")
    assert file_problems(tmp_path, files) == [
        "shard0.pt has 500 bytes, not 1000 (truncated?)",
        "shard1.pt fails its checksum (corrupt)",
        "shard2.pt is missing",
    ]


def test_unverifiable_checkpoints_are_refused_unless_trusted_and_damaged_ones_always(tmp_path):
    make_checkpoint(tmp_path)
    check_checkpoint(tmp_path)
    os.remove(tmp_path / "manifest.json")
    with pytest.raises(UserError, match=re.escape(NO_MANIFEST) + ".*--trust-checkpoint"):
        check_checkpoint(tmp_path)
    check_checkpoint(tmp_path, trust=True)

    make_checkpoint(tmp_path)
    os.remove(tmp_path / "shard2.pt")
    with pytest.raises(UserError, match="damaged: shard2.pt is missing"):
        check_checkpoint(tmp_path, trust=True)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: "\x00" * len(text),  # zeroed
        lambda text: text.replace('"bytes": ', '"bytes": "'),  # valid JSON, malformed entries
        lambda text: json.dumps({"version": 2}),  # no file list
    ],
)
def test_a_corrupt_manifest_is_refused_even_when_trusted(tmp_path, damage):
    make_checkpoint(tmp_path)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(damage(manifest.read_text()))
    with pytest.raises(CorruptManifest, match="cannot be verified"):
        read_manifest(tmp_path)
    with pytest.raises(UserError, match="damaged: manifest.json cannot be read.*even with --trust-checkpoint"):
        check_checkpoint(tmp_path, trust=True)


@pytest.mark.parametrize("background", [False, True])
def test_engine_checksums_what_it_writes_and_records_failed_writes(tmp_path, background):
    engine = ManifestCheckpointEngine(background=background)
    state = {"weight": torch.arange(1000.0), "step": 3, "names": ["a", "b"]}
    engine.save(state, str(tmp_path / "good.pt"))
    engine.save(state, str(tmp_path / "missing_dir" / "bad.pt"))
    written, errors = engine.finish(lambda written, errors: (written, errors)).result()

    assert written == {
        str(tmp_path / "good.pt"): {
            "bytes": os.path.getsize(tmp_path / "good.pt"),
            "crc32": crc32_of(tmp_path / "good.pt"),
        }
    }
    assert len(errors) == 1 and "bad.pt" in errors[0] and "No such file or directory" in errors[0]
    loaded = engine.load(str(tmp_path / "good.pt"))
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["names"] == ["a", "b"]


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_unpickles_code_but_reads_deepspeed_state(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    evil = RunsCode()
    evil.marker = tmp_path / "pwned"
    torch.save({"weight": torch.ones(2), "payload": evil}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        load_tensors(tmp_path / "evil.pt")
    with safe_loading(), pytest.raises(pickle.UnpicklingError):  # even where DeepSpeed asks for pickle
        torch.load(tmp_path / "evil.pt", weights_only=False)
    assert not evil.marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ

    torch.save(
        {
            "loss_scaler": DynamicLossScaler(
                init_scale=2.0**8, scale_window=10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
            )
        },
        tmp_path / "ds.pt",
    )
    assert load_tensors(tmp_path / "ds.pt")["loss_scaler"].cur_scale == 2.0**8


def test_retention_keeps_the_last_k_every_mth_and_always_the_newest():
    steps = [2, 4, 6, 8, 10, 12]
    assert tags_to_keep(steps, keep_last=2, keep_every=0) == {10, 12}
    assert tags_to_keep(steps, keep_last=2, keep_every=4) == {4, 8, 10, 12}
    assert tags_to_keep(steps, keep_last=0, keep_every=0) == set(steps)
    assert tags_to_keep([2, 4, 6], keep_last=1, keep_every=5) == {6}


def test_rng_states_round_trip_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = json.loads(json.dumps(rng_state()))
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2).tolist())
    set_rng_state(saved)
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2).tolist()) == first


GRACE_SCRIPT = """
import os, signal, time
from types import SimpleNamespace
from llmstack.training.faults import FaultGuard
cfg = SimpleNamespace(max_nonfinite_steps=1, loss_spike_factor=0.0, loss_spike_window=1, sigterm_grace_s=0.5)
with FaultGuard(cfg, fp16=False, device="cpu"):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(600)  # a save that never finishes
"""


def test_a_save_that_outlasts_the_sigterm_grace_period_ends_the_process():
    # A hang guard only (the grace period is 0.5 s): starting python and torch can take a minute on a busy machine.
    result = subprocess.run([sys.executable, "-c", GRACE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 128 + 15, result.stderr
    assert "SIGTERM: saving a checkpoint" in result.stderr and "grace period ran out" in result.stderr


def test_fault_guard_restores_a_handler_installed_outside_python(monkeypatch):
    """signal.signal returns None for a handler set from C; leaving the guard must not pass it back."""
    from types import SimpleNamespace

    from llmstack.training.faults import FaultGuard

    real_signal = signal.signal
    restored = {}

    def fake_signal(signum, handler):
        restored[signum] = handler
        real_signal(signum, signal.SIG_DFL if handler is None else handler)
        return None

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(signal, "signal", fake_signal)
    cfg = SimpleNamespace(max_nonfinite_steps=1, loss_spike_factor=0.0, loss_spike_window=1, sigterm_grace_s=0.5)
    try:
        with FaultGuard(cfg, fp16=False, device="cpu"):
            pass
    finally:
        for s, handler in previous.items():
            real_signal(s, handler)
    assert restored == {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.SIG_DFL}
