# Quick start: `make demo` and `make test`. Both create/update .venv as needed.
# `make demo KEEP=1` keeps the demo's working directory (its path is printed first);
# `make bench FULL=1` adds the sizes that take minutes (a ~400 MB checkpoint).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export OMP_NUM_THREADS ?= 2

.PHONY: demo test test-slow bench lint clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile setup.py $(wildcard gefen/csrc/*.[ch] gefen_ckpt/csrc/*.[ch])
	@echo "installing into $(VENV): torch (CPU) and gefen with its test/bench/torchft extras; a few minutes the first time"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,bench,torchft]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py $(if $(KEEP),--keep)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all $(if $(FULL),--full)

lint: $(STAMP)
	$(BIN)/ruff check gefen gefen_ckpt cli tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache gefen/_*.so gefen_ckpt/_*.so
