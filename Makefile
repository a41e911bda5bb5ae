# Entry points named in the README. `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := demo
PYTEST_ARGS ?=
# The suite runs in this many pytest-xdist workers, a test file per worker at a time (1: one process, no xdist).
# Three on the 2-core CI machine: much of the suite waits on services it started (startups, drains, connection
# ages, step timeouts) and a third worker fills those waits. In place, one after the other on the same box, the
# same tests took 506 s of pytest in two workers and 478 s in three; on fresh clones (cold caches: the suite is
# then bound by the two cores) 532 s in two and 533 s in three.
PYTEST_WORKERS ?= 3

AIPERF_VENV ?= .venv-aiperf

.PHONY: setup run demo demo-check demo-tpu demo-tpu-check protos proto-baseline lint test test-fast compose-check bench bench-docs bench-engine clean help

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/:/'

setup: $(VENV)/.installed node_modules/.installed  ## create .venv with the pinned packages and the test tools, install buf

# What `make run` needs: the serving packages and the clients the README calls (pip install -e also builds the
# kernels). pip shows each package as it goes: the first install takes minutes.
$(VENV)/.serving: pyproject.toml setup.py $(wildcard model_service/kernels/native/*)
	@echo "make: installing the serving packages into $(VENV) (once; a few minutes on a fresh machine)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar off --upgrade pip
	@echo "make: installing grok-serve itself, which compiles its native int8 kernels (C++): pip shows no progress meanwhile"
	$(PY) -m pip install --progress-bar off -e '.[client]'
	touch $@

# The test extra's packages, not `pip install -e '.[test]'`, which would build the project (and the kernels) again.
$(VENV)/.installed: $(VENV)/.serving
	@echo "make: installing the test tools into $(VENV)"
	$(PY) scripts/extra_requirements.py test > $(VENV)/test-requirements.txt
	$(PY) -m pip install --progress-bar off -r $(VENV)/test-requirements.txt
	@echo "make: compiling the installed packages' bytecode into build/pycache, where make test's processes read it"
	env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/build/pycache $(PY) -m compileall -q -j 0 \
	  $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

demo: setup  ## train the small demo model (preset cpu) into demo/ (tokenizer, config, int8 checkpoint, training.json; minutes)
	$(PY) -m demo_build --preset cpu --out $(DEMO)

demo-check: setup  ## retrain the cpu preset into build/demo-check; fail unless its losses match demo/training.json (a cpu run's)
	$(PY) -m demo_build --preset cpu --out build/demo-check --compare-with $(DEMO)/training.json

# On an accelerator host, where the project is not installed: `make demo-tpu TRAIN_PY=python3 TAR=DIR`.
TRAIN_PY ?= $(PY)
demo-tpu:  ## on one accelerator chip: train the embedded default (preset tpu) into demo/ (~5 min on a TPU v5e; TAR=DIR also writes it as DIR/demo.tar.NNN)
	$(TRAIN_PY) -m demo_build --preset tpu --out $(DEMO) $(if $(TAR),--tar $(TAR))

demo-tpu-check:  ## on the same kind of chip: retrain the tpu preset into build/demo-check; fail unless its losses match demo/training.json
	$(TRAIN_PY) -m demo_build --preset tpu --out build/demo-check --compare-with $(DEMO)/training.json

run: $(VENV)/.serving  ## install what serving needs, serve the embedded demo model, stream a sample (options: ARGS="--http-port 8080 ...")
	$(PY) scripts/run_stack.py $(ARGS)

protos: $(VENV)/.installed  ## regenerate the Python stubs from protos/
	$(PY) scripts/gen_protos.py

lint: setup  ## buf lint + buf breaking against the committed API baseline + stale-stub check
	npx --no-install buf lint
	npx --no-install buf breaking --against protos/baseline.binpb
	$(PY) scripts/gen_protos.py --check

proto-baseline: setup  ## accept the current protos as the API baseline `make lint` checks for breaking changes
	npx --no-install buf build -o protos/baseline.binpb

# Bytecode is cached (under build/pycache, outside the source tree) even where PYTHONDONTWRITEBYTECODE is set:
# otherwise every service process a test starts, and each worker's assertion rewriting, compiles the project's
# sources again. The prefix hides the bytecode pip wrote beside the installed packages, so setup compiles theirs
# there once (18 s on 2 cores); without it the processes of a fresh clone's first run each compiled jax & co.
# (3.3 s of a service's start) until one had written them. Test files are handed out longest first
# (tests/conftest.py), not by their number of tests.
# Both print the run's estimate from tests/file_seconds.json as they start, then progress by that recorded time
# every 10 % (pytest's own percentage counts tests, which the longest-first order front-loads with few of them).
PYTEST_RUN = env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/build/pycache \
	  $(PY) -m pytest $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
FAST_FILE_SECONDS ?= 5

test: setup lint  ## set up, lint the protos, run every test (7-15 min on 2 cores: README.md, "Tests")
	$(PYTEST_RUN) $(PYTEST_ARGS)

# The end-to-end files (marked slow) are left out even when short: they share stacks that another file starts.
test-fast: setup  ## the quick subset: test files that took at most 5 s each in the recorded run, not the end-to-end ones
	$(PYTEST_RUN) --max-file-seconds $(FAST_FILE_SECONDS) -m "not slow" $(PYTEST_ARGS)

compose-check: setup  ## docker compose for real: build the image, up --wait, gRPC + HTTP, --scale model=2, multiprocess, down (when no engine runs and root: installs podman, writes /etc/containers/containers.conf if absent, starts podman's API service, saying so first)
	$(PY) scripts/compose_check.py

bench: setup $(AIPERF_VENV)/.installed  ## quick benchmarks (minutes): gateway sweep, layer split, roofline, tokenizer, three-client cross-check -> benchmarks/measured/local/quick
	$(PY) -m benchmarks.suite --quick --out benchmarks/measured/local/quick

bench-docs: setup  ## re-measure everything docs/benchmarks.md reports (about an hour) and regenerate its tables
	$(PY) -m benchmarks.suite --out benchmarks/measured --update-doc docs/benchmarks.md

# AIPerf (run by benchmarks.crosscheck) gets its own virtualenv: its dependencies are not pinned with ours
# (sentencepiece is for scripts/hf_tokenizer.py, which builds its Hugging Face tokenizer offline).
$(AIPERF_VENV)/.installed:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0 sentencepiece==0.2.3
	touch $@

# docs/performance.md: each row names the target that measures it again, with the arguments its JSON was measured
# with. JSON goes to BENCH_OUT (ignored by git); to publish one, copy it into benchmarks/measured/, point the row at it
# (benchmarks/perf_rows.py) and `make bench-page`. The configs are ../shared/bench's. LLAMACPP=DIR runs llama.cpp
# beside ours (`bash ../shared/bench/llamacpp/run.sh DIR [CONFIG]` builds it, ~7 min; the rows' ratios need it),
# BEFORE=DIR alternates another checkout with this one, BENCH_ARGS goes last (its flags win). Run them alone on the box.
BENCH_OUT ?= benchmarks/measured/local
LLAMACPP ?=
BEFORE ?=
BENCH_ARGS ?=
CGROUP ?=
BENCH_ARMS = $(if $(BEFORE),--repo before=$(BEFORE)) --repo now=.
BENCH_LLAMACPP = $(if $(LLAMACPP),--llamacpp $(LLAMACPP))
SPEC_K8 = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
.PHONY: bench-page bench-cpu-medium bench-cpu-medium-engine bench-cpu-medium-slots bench-cpu-long-prompt \
  bench-cpu-grok1-width bench-cpu-grok1-width-int8 bench-cpu-grok1-width-int8-burst bench-cpu-limit \
  bench-cpu-speculative bench-cpu-activation-error bench-tpu

bench-page:  ## rewrite docs/performance.md's tables from the JSON in benchmarks/measured (no measuring)
	$(PY) -m benchmarks.render_docs

bench-cpu-medium: setup  ## medium as a user starts it, speed.py 1 and 8 streams
	$(PY) -m benchmarks.as_user $(BENCH_ARMS) --runs 3 $(BENCH_LLAMACPP) --out $(BENCH_OUT)/as-user-medium.json $(BENCH_ARGS)

bench-cpu-medium-engine: setup  ## medium over gRPC: one prompt and 8 simultaneous prompts' first tokens, 1 and 8 streams
	$(PY) -m benchmarks.engine $(BENCH_ARMS) --runs 2 --modes sampled --points slots1_stream1,slots8_streams8 \
	  $(BENCH_LLAMACPP) --out $(BENCH_OUT)/engine-medium.json $(BENCH_ARGS)

bench-cpu-medium-slots: setup  ## medium over gRPC: 1 stream on 1 and on 16 slots, 8 streams, sampled and greedy
	$(PY) -m benchmarks.engine $(BENCH_ARMS) --runs 2 --modes sampled,greedy $(BENCH_LLAMACPP) \
	  --out $(BENCH_OUT)/engine-medium-slots.json $(BENCH_ARGS)

bench-engine: bench-cpu-medium-slots  ## the same as bench-cpu-medium-slots

bench-cpu-long-prompt: setup  ## medium at context 8,192: a 6,000-token prompt beside 7 streams, and alone
	$(PY) -m benchmarks.long_prompt $(if $(BEFORE),--repo before=$(BEFORE)) $(BENCH_LLAMACPP) \
	  --out $(BENCH_OUT)/long-prompt.json $(BENCH_ARGS)

bench-cpu-grok1-width: setup  ## Grok-1 width (one layer, ~8 GB a service): 1 and 8 streams, prompts, memory
	$(PY) -m benchmarks.engine --grok1-width $(BENCH_ARMS) --runs 1 --tokens 32 $(BENCH_LLAMACPP) \
	  --out $(BENCH_OUT)/engine-grok1-width.json $(BENCH_ARGS)

bench-cpu-grok1-width-int8: setup  ## the same with --products native-int8 (the opt-in that changes results)
	GROK_MODEL_PRODUCTS=native-int8 $(PY) -m benchmarks.engine --grok1-width $(BENCH_ARMS) --runs 1 --tokens 32 \
	  $(BENCH_LLAMACPP) --out $(BENCH_OUT)/engine-grok1-width-int8.json $(BENCH_ARGS)

bench-cpu-grok1-width-int8-burst: setup  ## --products native-int8: 8 simultaneous prompts, two runs
	GROK_MODEL_PRODUCTS=native-int8 $(PY) -m benchmarks.engine --grok1-width $(BENCH_ARMS) --points slots8_streams8 \
	  --runs 2 --tokens 32 $(BENCH_LLAMACPP) --out $(BENCH_OUT)/engine-grok1-width-int8-burst.json $(BENCH_ARGS)

bench-cpu-limit: setup  ## medium under a CPU limit: CGROUP=DIR, a cgroup with a quota that you may write to
	$(if $(CGROUP),,$(error CGROUP=DIR is required: a cgroup with a CPU quota, e.g. /sys/fs/cgroup/cpu/q1))
	$(PY) -m benchmarks.as_user $(BENCH_ARMS) --runs 3 --cgroup $(CGROUP) --out $(BENCH_OUT)/as-user-medium-cpu-limit.json \
	  $(BENCH_ARGS)

bench-cpu-speculative: setup  ## speculative decoding on and off: the demo model's continue prompts, medium
	$(PY) -m benchmarks.speculative --runs 2 --workloads continue,medium --spec $(SPEC_K8) \
	  --out $(BENCH_OUT)/speculative.json $(BENCH_ARGS)

bench-cpu-activation-error: setup  ## --products native-int8 against the reference's logits on the golden sets
	mkdir -p $(BENCH_OUT)
	$(PY) -m benchmarks.activation_error $(BENCH_ARGS) > $(BENCH_OUT)/activation-error.json

# On the TPU host (no venv, no TCP sockets there; ../shared/device/README.md): each program in its own process,
# one JSON for the page (split over calls: python -m benchmarks.device --merge A.json B.json --out ...),
#   bash .device/on-device.sh make bench-tpu PY=python3
bench-tpu:  ## on the chip: medium and Grok-1 width (1 and 2 layers) points, each beside its bound, golden parity (~8 min)
	$(PY) -m benchmarks.device --points parity,medium,grok1-1layer,grok1-2layer --sets golden $(BENCH_ARGS) \
	  --out $(BENCH_OUT)/device-tpu-v5e.json

clean:  ## remove build outputs (not the venv)
	rm -rf .pytest_cache build *.egg-info
