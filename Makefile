# Set-up, demo, tests and checks. Everything installs into .venv; nothing is installed globally.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# PyTorch to install when the venv has none. The default is the CPU build that CPU-only
# machines carry; on a GPU machine use e.g. `make TORCH=torch demo` for the CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: setup prometheus sshd demo test lint check bench gpu-check clean

# torch's wheel leaves numpy out; without it every job starts with "Failed to initialize NumPy".
$(BIN)/torchtop: pyproject.toml tests/requirements-frameworks.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/python -c "import numpy" 2>/dev/null || $(BIN)/pip install -q numpy
	$(BIN)/pip install -q -e '.[dev]'
# Real frameworks for the tests only (Lightning, the HF Trainer); the package needs none.
	$(BIN)/pip install -q -r tests/requirements-frameworks.txt
	@touch $@

setup: $(BIN)/torchtop prometheus

# The real Prometheus (and promtool) that the exporter's tests scrape with: Debian's package,
# installed where it is missing and we are root. Elsewhere those tests skip, saying why.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
	  >/dev/null; } || echo "prometheus not installed (needs root and apt-get): its tests skip"

# OpenSSH's server, for the one test that reaches a simulated node through a real sshd (on
# 127.0.0.1, its own config and a throwaway key; the system's service is not started here).
# Opt-in, not part of setup: on a machine with systemd the package starts a system service.
sshd:
	@command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  openssh-server >/dev/null; } || echo "sshd not installed (needs root and apt-get): its test skips"

demo: setup
	$(BIN)/torchtop demo broadcasting

# Most tests wait on real jobs (a job's start, its frames): two at once keep 2 cores busy. A file
# stays on one worker (its jobs share fixtures). `make test WORKERS=0` runs them one by one.
WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=15

lint: setup
	$(BIN)/ruff check torchtop demos tests benchmarks
	$(BIN)/ruff format --check torchtop demos tests benchmarks
	$(BIN)/mypy

check: lint test

bench: setup
	$(BIN)/python -m benchmarks.agent_overhead
	$(BIN)/python -m benchmarks.hook_cost
	$(BIN)/python -m benchmarks.stalled_viewer
	$(BIN)/python -m benchmarks.tracker_overhead
	$(BIN)/python -m benchmarks.export_overhead
	$(BIN)/python -m benchmarks.viewer_cost

# On a GPU machine, with the system's PyTorch (CUDA), nvidia-ml-py, psutil and rich: no venv,
# no install, nothing fetched. See README "Checking on a GPU".
OUT ?= gpu-check-out
gpu-check:
	PYTHONPATH=. $(PYTHON) -m benchmarks.gpu_check --out $(OUT)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
