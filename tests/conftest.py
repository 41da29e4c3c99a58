"""Shared fixtures: a tiny random-weight Llama with a sentencepiece tokenizer trained on the shipped
prompts (built once per session by tests/helpers.py), and the real default model for the few tests
that need it. Nothing is imported from here: what tests share is in tests/helpers.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CHUNKGEN_CHECK_CONTEXT", "1")  # every kernel context is fully validated

import chunkgen  # noqa: E402, F401  (before torch loads: the OpenMP settings it makes)
from tests.helpers import TINY_CONFIG, build_tiny_model  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen"), arch="qwen2", seed=1)


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """TINY_CONFIG as a config.json, for --dummy-weights."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    from chunkgen.llm import LLM

    return LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=16)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family name -> a tiny random model of that family (tests/model/test_families.py), built once
    a session for every test that compares a family with transformers."""
    from tests.model.test_families import FAMILIES, _build

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = _build(tmp_path_factory.mktemp(family), family, seed=FAMILIES.index(family))
        return built[family]

    return get


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's cache folder with its float copy (the GGUF dequantized by transformers,
    made once per cache): what the parity tests load into transformers."""
    from chunkgen.model import ModelNotFound, resolve_model
    from chunkgen.model.loading import float_weights

    try:
        return float_weights(resolve_model(None))
    except ModelNotFound as exc:  # the README's set-up (make test) installs it
        pytest.skip(f"real_model test skipped: {exc}")
