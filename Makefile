# Entry points named in the README. `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := demo
PYTEST_ARGS ?=

.PHONY: setup run demo demo-check protos lint test bench clean help

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

demo: setup  ## retrain the committed demo model into demo/ (tokenizer, int8 checkpoint, training.json; minutes)
	$(PY) -m model_service.train --out $(DEMO)

demo-check: setup  ## retrain into build/demo-check and fail unless its losses match demo/training.json
	$(PY) -m model_service.train --out build/demo-check --compare-with $(DEMO)/training.json

run: setup  ## set up, then serve the embedded default (the committed demo/: tokenizer + model + gateway), stream a sample
	$(PY) scripts/run_stack.py --prompt "The model service" --max-tokens 48

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
	$(PY) bench/bench_engine.py --configs golden,medium --matched 1,8

clean:  ## remove build outputs (not the venv)
	rm -rf .pytest_cache build *.egg-info
