# Set-up, demo, tests and checks. Everything installs into .venv; nothing is installed globally.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# PyTorch to install when the venv has none. The default is the CPU build that CPU-only
# machines carry; on a GPU machine use e.g. `make TORCH=torch demo` for the CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: setup system-deps sshd demo test test-fast lint docs check bench gpu-check clean

# The demo's venv: torch (the CPU file on a CPU machine), numpy (torch's wheel leaves it out, and
# every job would start with "Failed to initialize NumPy"), and torchtop with its own requirements.
# Nothing else, and nothing outside .venv.
$(VENV)/.demo: pyproject.toml setup.py Makefile
	@echo "make: setting up $(VENV) for the demo: $(TORCH) (if the venv has no torch), numpy, torchtop"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/python -c "import numpy" 2>/dev/null || $(BIN)/pip install -q numpy
	$(BIN)/pip install -q -e .
	@touch $@

# The tests' venv: the demo's, plus test tools, the exporters' pinned versions, the docs' builder
# and the real frameworks some tests run under torchtop (Lightning, the HF Trainer).
$(BIN)/torchtop: $(VENV)/.demo tests/requirements-frameworks.txt
	@echo "make: adding the test tools and tests/requirements-frameworks.txt to $(VENV)"
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q -r tests/requirements-frameworks.txt
	@touch $@

setup: $(BIN)/torchtop

# System packages some tests use, each test skipping with the reason where its tool is missing:
# Debian's prometheus (a real server the exporter is scraped by), tmux (the viewer in a real
# terminal) and gdb (attach). Installed only when asked, or by `make check` in CI (CI=true),
# as root with apt-get; what will be installed is printed first.
SYSTEM_DEPS ?= prometheus tmux gdb
system-deps:
	@missing=""; for p in $(SYSTEM_DEPS); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then echo "make: system packages present:$(SYSTEM_DEPS:%= %)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing Debian packages with apt-get:$$missing (and what they depend on)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $$missing && echo "make: installed:$$missing"; \
	else echo "make: not installed:$$missing (needs root and apt-get); their tests skip"; fi

# OpenSSH's server, for the one test that reaches a simulated node through a real sshd (on
# 127.0.0.1, its own config and a throwaway key; the system's service is not started here).
# Opt-in: on a machine with systemd the package starts a system service.
sshd:
	@command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  echo "make: installing Debian's openssh-server with apt-get" && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; } || \
	echo "make: sshd not installed (needs root and apt-get): its test skips"

# A demo stopped from its viewer (q, then s) or with Ctrl-C ends with the job's 130: a user's
# choice, not make's error.
demo: $(VENV)/.demo
	$(BIN)/torchtop demo broadcasting || [ $$? -eq 130 ]

# Most tests wait on real jobs (a job's start, its frames): two at once keep 2 cores busy. A file
# stays on one worker (its jobs share fixtures). `make test WORKERS=0` runs them one by one.
WORKERS ?= 2
# A test that fails is run once more, alone: one that fails again fails the run; one that then
# passes is flaky (it shows as FAILED above, with why), to be fixed, not hidden.
# The tests come in four folders, by what they need (tests/README.md): unit (in-process, a minute),
# gpu (recorded GPU data, a fake NVML), viewer (Pilot, snapshots, tmux), processes (real jobs,
# launchers, servers). `make test TESTS=tests/viewer` runs one; `make test-fast`, the quick two.
TESTS ?= tests
# The suite starts some 700 Python processes. Where PYTHONDONTWRITEBYTECODE is set, each would
# compile torchtop's modules again: they are compiled once, first.
test: setup $(if $(filter true 1,$(CI)),system-deps)
	$(BIN)/python -m compileall -q torchtop demos tests >/dev/null
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=15 $(TESTS) || { \
	  echo "make: the tests that failed run once more, one at a time: failing again fails the run"; \
	  $(BIN)/python -m pytest -q -p no:xdist --last-failed --last-failed-no-failures none $(TESTS); }

test-fast:
	$(MAKE) test TESTS="tests/unit tests/gpu"

# Style, types, and the import rules between torchtop's packages ([tool.importlinter] in
# pyproject.toml; what an import really loads at run time: tests/processes/test_boundaries.py).
lint: setup
	$(BIN)/ruff check torchtop demos tests benchmarks tools setup.py
	$(BIN)/ruff format --check torchtop demos tests benchmarks tools setup.py
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

# The docs site into site/; any broken link, anchor or missing page fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

check: lint docs test

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
