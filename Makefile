# The two commands a newcomer needs:  `make demo`  and  `make test`.
# Each creates .venv on first use and installs what it needs (torch pinned: the CPU wheel).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0

.PHONY: demo test install lint clean screenshots

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[server,dev]'
	touch $(STAMP)

install: $(STAMP)

## make demo: server + dashboard on embedded SQLite, with a real fp16 training run streaming into it.
## Extra flags: make demo ARGS="--steps 300 --exit"
demo: $(STAMP)
	$(VENV)/bin/gradwatch demo $(ARGS)

## make test: the whole test suite (PostgreSQL and browser tests run when their services exist;
## with GRADWATCH_CI=1 a missing service is a failure instead of a skip), in TEST_WORKERS processes
## (pytest-xdist; most tests wait on servers, subprocesses and browsers): make test TEST_WORKERS=0 runs
## it in this process alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -ra -n $(TEST_WORKERS) $(PYTEST_ARGS)

## make lint: what CI runs before the tests (the pre-commit hooks run the same three): ruff's lint
## rules, ruff's formatting (check only; `ruff format` applies it) and mypy, configured in pyproject.toml.
## .ci/typecheck.py mirrors the package-dir mapping as a symlink tree for mypy, then runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) .ci/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info

## make screenshots: regenerate docs/*.png from a real demo run in headless Chromium.
screenshots: $(STAMP)
	$(PY) docs/make_screenshots.py
