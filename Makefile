# `make test` and `make demo` each set up .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; a GPU machine can preinstall its own build in .venv.
TORCH_SPEC ?= torch==2.13.0
# Extra pip arguments for torch, e.g. --index-url https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
DEMO_ARGS ?=
# The GPU figures' oracle in the tests; without its notebook requirement (jupyterlab).
HTA_SPEC ?= holistictraceanalysis==0.5.0
# SkyRL, whose own profiler calls the attach hook drives (tests/test_attach_jobs.py); without its
# dependencies (it pins transformers<=5.8.0): the few its modules import are in the test extras.
SKYRL_SPEC ?= skyrl==0.3.0

.PHONY: venv browser docker-engine test test-docker test-fast lint format demo bench fuzz reference clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "$(HTA_SPEC)"
	$(PY) -m pip install -q --no-deps "$(SKYRL_SPEC)"
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Debian's chromium for the web view's browser test (Playwright's own download is unreachable).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

# Debian's Docker engine and docker-compose (v1) for the image's test, and debootstrap for its
# base (Docker Hub is unreachable). Where they cannot be installed the test skips, saying why.
docker-engine:
	@command -v docker-compose >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1 \
	  && command -v debootstrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q docker.io docker-compose debootstrap \
	  || echo "docker.io could not be installed: tests/test_docker.py will skip"; }

# The whole suite: lint, types, then every test (Ray clusters, subprocesses, S3, the browser,
# the demo, the Docker image). -rs prints why any test skipped; a test of what `make venv`
# installs (SkyRL) fails instead of skipping when it is missing (RAY_PROFILER_EXTRAS_PROMISED).
test: lint browser docker-engine
	RAY_AUTH_MODE=disabled RAY_PROFILER_EXTRAS_PROMISED=1 $(PY) -m pytest -q -rs --durations=15

# The Docker image alone: the test base, the image, two nodes, the demo, status, top, collect.
test-docker: venv docker-engine
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -rs tests/test_docker.py

# Lint, types and every test that needs no Ray and no subprocess (starting either fails there).
test-fast: lint
	PROFILER_FAST_TIER=1 $(PY) -m pytest -q -m "not ray and not subprocess"

demo: venv
	RAY_AUTH_MODE=$${RAY_AUTH_MODE:-disabled} $(PY) -m trainers.demo $(DEMO_ARGS)

# The hostile-callers fuzz, longer than the fixed-seed run in `make test`.
fuzz: venv
	RAY_AUTH_MODE=disabled FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-5000} $(PY) -m pytest -q tests/test_hostile_callers.py

bench: venv
	$(PY) bench/rank_profiler_overhead.py
	RAY_AUTH_MODE=disabled $(PY) bench/coordinator_overhead.py
	RAY_AUTH_MODE=disabled $(PY) bench/spmd_step.py
	RAY_AUTH_MODE=disabled $(PY) bench/attach_step.py
	RAY_AUTH_MODE=disabled $(PY) bench/summary_cost.py
	RAY_AUTH_MODE=disabled $(PY) bench/window_cost.py
	$(PY) bench/summarise_cost.py
	$(PY) bench/summary_memory.py
	RAY_AUTH_MODE=disabled $(PY) bench/upload_cost.py
	RAY_AUTH_MODE=disabled $(PY) bench/stack_cost.py
	$(PY) bench/status_cost.py
	$(PY) bench/relay_cost.py
	$(PY) bench/record_cost.py
	RAY_AUTH_MODE=disabled $(PY) bench/state_store_cost.py --restart
	$(PY) bench/memory_sampling.py

# docs/reference.md and docs/replies.md from the code (tests/test_docs.py fails when they differ).
reference: venv
	$(PY) -m coordinator.ops.reference docs

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
