# Quick start:  make demo   (sets up, then runs a real 2-rank job with an injected hang, diagnosed live)
#               make test   (sets up from nothing, then lint, types, and the whole test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
SCENARIO ?= early_stop

.PHONY: setup dev demo test lint typecheck unit protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# A real (non-editable) install of the package with its test extras, torch 2.13.0 CPU included.
setup: $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0" 
	$(BIN)/pip install -q ".[test]"

# Development: the source tree importable as `hangwatch` through symlinks (see scripts/devlink.py).
dev: setup
	$(BIN)/pip uninstall -q -y hangwatch
	$(BIN)/python scripts/devlink.py

demo: setup
	$(BIN)/hangwatch demo $(SCENARIO)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/python scripts/devlink.py --tree-only build/typecheck
	cd build/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p hangwatch

protos: setup
	$(BIN)/python protos/generate.py

test: setup lint typecheck
	$(BIN)/pytest -q -ra

clean:
	rm -rf $(VENV) .dev build dist
