# Quick start: `make demo` and `make test`. Both create/update .venv as needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export OMP_NUM_THREADS ?= 2

.PHONY: demo test test-slow bench lint clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile setup.py $(wildcard gefen/csrc/*.[ch] gefen_ckpt/csrc/*.c)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/compare_adamw.py
	$(BIN)/python examples/train_reshard_resume.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

lint: $(STAMP)
	$(BIN)/ruff check gefen gefen_ckpt cli tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache gefen/_*.so
