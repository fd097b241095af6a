# Quick start:  make demo   (sets up, then runs a real 2-rank job with an injected hang, diagnosed live)
#               make test   (sets up from nothing, then lint, types, and the whole test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
SCENARIO ?= early_stop
# 1: an install that cannot compile the hook's C fast path fails (0: it installs pure Python)
REQUIRE_NATIVE ?= 1

.PHONY: setup demo test lint typecheck unit native soak protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# An editable install of the package with its test extras (torch 2.13.0 CPU included): edits to
# hangwatch/ take effect at once, in tests, in the `hangwatch` command and in attached ranks.
# The hook's C fast path is compiled by that install (hatch_build.py): a change to its source
# installs again, and a compile that fails fails the install (REQUIRE_NATIVE=0 to go on without).
$(VENV)/.installed: pyproject.toml hatch_build.py hangwatch/client/_fastpath.c | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	HANGWATCH_REQUIRE_NATIVE=$(REQUIRE_NATIVE) $(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/hangwatch demo $(SCENARIO)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

protos: setup
	$(BIN)/python scripts/generate_protos.py

# The edit loop: tests that start no job and run no flood or fuzz campaign (about 25 s on 2 cores).
unit: setup
	$(BIN)/pytest -q -n 2 -m "not slow and not soak"

# The C fast path built with every other Python the machine has (3.10 to 3.14, each found under
# pyenv or on PATH; one absent is skipped, saying so), and the tests that need no torch run on each
# (scripts/check_native.py; about 1.5 min, a venv per version under .venv/native made once).
native: setup
	$(BIN)/python scripts/check_native.py

# Two workers, one test file each at a time (a file's jobs share its module fixtures): the jobs
# mostly wait (on detection thresholds, on gloo), so two at once fit 2 cores (8 min vs 12 serial).
# The native check runs beside them, in that waiting; its output is shown after theirs.
test: setup lint typecheck
	@$(BIN)/python scripts/check_native.py > .venv/native.log 2>&1 & native=$$!; \
	$(BIN)/pytest -q -ra -n 2 --dist loadfile --durations=15; rc=$$?; \
	wait $$native; nrc=$$?; cat .venv/native.log; \
	[ $$rc -eq 0 ] && [ $$nrc -eq 0 ]

# The property tests and floods, the longest included (CI skips the 128- and 1,024-rank floods
# and the 10-minute simulated job: see tests/diagnosis/test_bounded_memory.py).
soak: setup
	HANGWATCH_LONG_SOAK=1 $(BIN)/pytest -q -n 2 -m soak

clean:
	rm -rf $(VENV) build dist
