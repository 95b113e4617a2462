import json
import struct

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from llmstack.errors import UserError
from llmstack.monitor import MetricsLogger
from llmstack.monitor.console import format_summary
from llmstack.monitor.redact import REDACTED, redact_secrets

ENV_KEY = "0123456789abcdef0123456789abcdef01234567"  # looks like a W&B key
CONFIG_SECRET = "hf_configsecret123456"
STEPS = (10, 20, 30)
METRICS = ("loss", "grad_norm", "lr", "tokens_per_s")


def step_metrics(step):
    return {"loss": 5.0 - step / 10, "grad_norm": 1.0 / step, "lr": 1e-4 * step, "tokens_per_s": 1000.0 + step}


def read_wandb_records(path):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log framed protobuf records
    (32 KiB blocks; each chunk has a CRC32, a little-endian length and a type:
    1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        block_left = 32768 - pos % 32768
        if block_left < 7:  # block trailer padding
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One run through every sink: W&B offline, TensorBoard, console and the JSONL file."""
    out_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_API_KEY", ENV_KEY)
        mp.setenv("WANDB_CONFIG_DIR", str(out_dir / "wandb-config"))
        run_config = {
            "model": {"hidden_size": 64, "pad_token": "<pad>"},
            "hf_token": CONFIG_SECRET,
            "note": f"key {ENV_KEY} pasted by mistake",
        }
        monitor_cfg = {"tensorboard": True, "wandb": {"project": "llmstack-test", "run_name": "tiny", "tags": ["cpu"]}}
        logger = MetricsLogger.from_config(monitor_cfg, out_dir, run_config, total_steps=30)
        for step in STEPS:
            logger.log(step, step_metrics(step))
        logger.close()
    return out_dir


def test_wandb_offline_run_holds_every_logged_metric(logged_run):
    (run_file,) = logged_run.glob("wandb/offline-run-*/run-*.wandb")
    records = read_wandb_records(run_file)
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    assert sorted(history) == list(STEPS)
    for step in STEPS:
        for name in METRICS:
            assert history[step][name] == pytest.approx(step_metrics(step)[name])

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "llmstack-test" and run.display_name == "tiny" and list(run.tags) == ["cpu"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["hf_token"] == REDACTED
    assert config["model"] == {"hidden_size": 64, "pad_token": "<pad>"}


def test_tensorboard_events_hold_every_logged_metric(logged_run):
    events = EventAccumulator(str(logged_run / "tensorboard"))
    events.Reload()
    for name in METRICS:
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == list(STEPS)
        assert [s.value for s in scalars] == pytest.approx([step_metrics(step)[name] for step in STEPS])


def test_jsonl_holds_every_logged_step(logged_run):
    records = [json.loads(line) for line in (logged_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(STEPS)
    assert records[-1]["loss"] == step_metrics(30)["loss"]


def test_no_secret_reaches_any_file_of_the_run(logged_run):
    files = [p for p in logged_run.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any("tfevents" in p.name for p in files)
    for path in files:
        data = path.read_bytes()
        assert ENV_KEY.encode() not in data, path
        assert CONFIG_SECRET.encode() not in data, path


def test_redact_secrets_by_key_name_and_by_environment_value():
    config = {
        "wandb": {"api_key": "abc", "project": "p"},
        "tokenizer": {"pad_token": "<pad>", "tokens_per_step": 4096},
        "layers": [{"access_token": "t"}, "uses s3cr3tvalue inline"],
        "password": "",
    }
    redacted = redact_secrets(config, secrets={"s3cr3tvalue"})
    assert redacted == {
        "wandb": {"api_key": REDACTED, "project": "p"},
        "tokenizer": {"pad_token": "<pad>", "tokens_per_step": 4096},
        "layers": [{"access_token": REDACTED}, f"uses {REDACTED} inline"],
        "password": "",
    }
    assert config["wandb"]["api_key"] == "abc"  # the input is left as it was


def test_console_prints_a_readable_line_per_logging_step(capsys, tmp_path):
    logger = MetricsLogger.from_config({}, tmp_path, total_steps=30)
    for step in STEPS:
        logger.log(step, {**step_metrics(step), "mfu": 0.25, "internal/thing": 1.0})
    logger.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step")]
    assert len(lines) == len(STEPS)
    assert lines[0].startswith("step 10/30 | loss 4.0000 | lr 1.00e-03 | grad 0.10 | 1.01k tok/s | MFU 25.0%")
    assert "eta" in lines[-2] and "internal" not in lines[-1]


def test_format_summary_skips_missing_and_nan_values():
    line = format_summary(7, {"loss": float("nan"), "val_loss": 2.5, "val_ppl": 12.18}, eta_seconds=75)
    assert line == "step 7 | val loss 2.5000 | val ppl 12.18 | eta 01:15"


def test_monitor_config_errors_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="unknown key.*tensorbord"):
        MetricsLogger.from_config({"tensorbord": True}, tmp_path)
    with pytest.raises(UserError, match="WANDB_API_KEY"):
        MetricsLogger.from_config({"wandb": {"api_key": "abc"}}, tmp_path)
    assert MetricsLogger.from_config({"console": False}, tmp_path, enabled=False).sinks == []
