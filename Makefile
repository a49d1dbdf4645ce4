# Entry points for a fresh machine with Python 3.11:
#   make train  - set up .venv and run the main job: fine-tune all-MiniLM-L6-v2 on BBC News
#   make demo   - set up .venv and show a real model with a head attached
#   make test   - set up .venv and run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Keep big buffers mapped between steps: glibc returning them to the OS each step costs
# JAX ~10-40% on CPU. Must be set before the process starts, so the launcher sets it.
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: setup train demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU build (any other spec pulls CUDA wheels)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[torch,examples,dev]"
	touch $(STAMP)

setup: $(STAMP)

# The main job (README "Quick start"): full fine-tune, max length 128, 2 epochs, learning rates
# 1e-4 backbone / 1e-3 head (the program's defaults; 5e-3 with --freeze-backbone); a new run folder
# under runs/ each time. Extra flags: make train ARGS="--freeze-backbone --epochs 5"
train: $(STAMP)
	$(BIN)/python -m flaxheads train --model all-MiniLM-L6-v2 --data bbc_news --max-length 128 --batch-size 16 \
		--epochs 2 $(ARGS)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

.PHONY: bench
# Performance: flaxheads vs HF Flax vs PyTorch eager, interleaved (each bench < ~3 min idle).
bench: $(STAMP)
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/train_step.py
	$(BIN)/python bench/cached_head.py

clean:
	rm -rf $(VENV) build *.egg-info
