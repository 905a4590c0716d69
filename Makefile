# The README's commands. Everything runs inside a local virtualenv (.venv).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := demo-out

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # CPU wheel first; a loose range would pull CUDA builds
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/bdsgd profile --workers 4 --iterations 60 --traces $(DEMO)/traces --stragglers synthetic --seed 0

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --out docs/benchmarks.md

clean:
	rm -rf $(DEMO) .pytest_cache
