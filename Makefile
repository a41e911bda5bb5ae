# Entry points named in the README. `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := artifacts/demo
PYTEST_ARGS ?=

.PHONY: setup run demo protos lint test bench clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/:/'

setup: $(VENV)/.installed node_modules/.installed  ## create .venv with the pinned packages, install buf

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(DEMO)/tokenizer.model: $(VENV)/.installed
	$(PY) -m tokenizer_service.train_demo --out $@

$(DEMO)/checkpoint/RANDOM_WEIGHTS.txt: $(VENV)/.installed configs/demo.json
	$(PY) -m model_service.demo_checkpoint --config configs/demo.json --out $(DEMO)/checkpoint

demo: $(DEMO)/tokenizer.model $(DEMO)/checkpoint/RANDOM_WEIGHTS.txt  ## build the embedded default (demo tokenizer + random-weight checkpoint)

run: setup demo  ## set up, then serve the embedded default (tokenizer + model + gateway) and stream a sample
	$(PY) scripts/run_stack.py

protos: $(VENV)/.installed  ## regenerate the Python stubs from protos/
	$(PY) scripts/gen_protos.py

lint: setup  ## buf lint + stale-stub check
	npx --no-install buf lint
	$(PY) scripts/gen_protos.py --check

test: setup lint  ## set up, lint the protos, run every test
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup  ## model + engine benchmarks (JSON on stdout)
	$(PY) bench/bench_model.py --config ../shared/bench/medium.json --batch 1
	$(PY) bench/bench_model.py --config ../shared/bench/medium.json --batch 8
	$(PY) bench/bench_engine.py --runs 3

clean:  ## remove build outputs (not the venv)
	rm -rf $(DEMO) .pytest_cache build *.egg-info
