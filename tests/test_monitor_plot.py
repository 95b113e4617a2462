import json

import matplotlib.image
import pytest

from llmstack.cli.main import main
from llmstack.errors import UserError
from llmstack.monitor import MetricsLogger
from llmstack.monitor.plot import panels_of, plot_run, read_metrics


def log_run(out_dir, steps=20):
    logger = MetricsLogger(out_dir, sinks=[])
    for step in range(1, steps + 1):
        logger.log(step, {"loss": 6.0 / step**0.5, "lr": 1e-3, "grad_norm": 1.0 / step, "tokens_per_s": 900.0 + step})
        if step % 10 == 0:
            logger.log(step, {"val_loss": 5.0 / step**0.5, "val_ppl": 20.0})
    logger.close()


def test_llmstack_plot_writes_a_png_of_the_run(tmp_path, capsys):
    log_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1200, 800)


def test_a_run_that_logs_accuracy_gets_its_panel_beside_the_loss(tmp_path):
    log_run(tmp_path)
    assert "Accuracy" not in [title for title, *_ in panels_of(read_metrics(tmp_path))]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 21, "loss": 1.0, "accuracy": 0.4}) + "\n")
        f.write(json.dumps({"step": 21, "val_loss": 1.1, "val_accuracy": 0.38}) + "\n")
    titles = [title for title, *_ in panels_of(read_metrics(tmp_path))]
    assert titles[:2] == ["Loss", "Accuracy"]
    height, width, _ = matplotlib.image.imread(plot_run(tmp_path)).shape
    assert (width, height) == (1200, 1200)  # five panels: three rows


def test_plot_tolerates_a_cut_off_last_line_and_a_panel_with_no_data(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "loss": 3.0}) + "\n" + '{"step": 2, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    out = plot_run(tmp_path, tmp_path / "custom.png")
    assert out == tmp_path / "custom.png" and out.stat().st_size > 0


def test_plot_errors_say_what_is_wrong(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError, match="record 2 is not valid JSON"):
        read_metrics(tmp_path)
