# `make quickstart` and `make test` do all the set-up a fresh machine needs.
PYTHON ?= python3
# CPU-only torch unless one is installed already (GPU machines: install the CUDA build first).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install quickstart test bench lint clean

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -e '.[dev]'

quickstart: install
	$(PYTHON) -m llmstack quickstart

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

bench: install
	for b in bench/bench_*.py; do echo "== $$b"; $(PYTHON) $$b || exit 1; done

lint:
	hadolint Dockerfile

clean:
	rm -rf runs build *.egg-info .pytest_cache
