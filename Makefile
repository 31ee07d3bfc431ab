# megatron-xdistill: `make demo` and `make test` work on a fresh clone (see README.md).
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch unless a CUDA GPU is visible (keeps a multi-GB CUDA download away from CPU boxes).
TORCH_SPEC ?= torch==2.13.0
MCORE_SPEC ?= megatron-core==0.19.2

.PHONY: install demo test test-slow test-gpu coverage mutate lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "GPU found: installing torch with CUDA"; $(BIN)/python -m pip install -q torch; \
	  else \
	    echo "no GPU: installing the CPU build $(TORCH_SPEC)"; $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; \
	  fi; \
	fi
	@# megatron-core >= 0.17 declares Python >= 3.12; its cp311 wheel runs on 3.11 (see README).
	@if $(BIN)/python -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then \
	  $(BIN)/python -m pip install -q --no-deps --ignore-requires-python "$(MCORE_SPEC)"; \
	fi
	$(BIN)/python -m pip install -q -e ".[test,examples]"
	@touch $(STAMP)

demo: install
	$(BIN)/python -m megatron_xdistill.demo

test: install lint
	@# pytest exits 5 when no test was collected; that is not a failure of the code.
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-slow: install
	$(BIN)/python -m pytest -q -m slow

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

# Line coverage of megatron_xdistill/ by package folder on the CPU suite (ranks and subprocesses
# included, see [tool.coverage.run] in pyproject.toml); data files that processes ending after
# pytest write are combined too. coverage.json keeps the report (tools/coverage_by_folder.py).
coverage: install
	@rm -f .coverage .coverage.*
	$(BIN)/python -m pytest -q --cov --cov-report=; rc=$$?; \
	  $(BIN)/coverage combine --append -q 2>/dev/null || true; \
	  $(BIN)/coverage json -q -o coverage.json && \
	  $(BIN)/python tools/coverage_by_folder.py coverage.json --files --write || rc=1; \
	  exit $$rc

# Mutation check of the loss's definitions, its chunk bookkeeping and the aligner's partition code
# (not in CI: ~40 min on 2 cores). Resumable: per-mutant results in tools/mutation_results/.
mutate: install
	$(BIN)/python tools/mutate.py

lint: install
	$(BIN)/ruff check .

bench: install
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .coverage .coverage.* coverage.json
