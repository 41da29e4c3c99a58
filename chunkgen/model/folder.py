"""A model folder is data, never code, and its numbers are claims to check.

Before transformers reads a folder (it would import a `.py` named by `auto_map`, after asking on
standard input), the folder's own JSON is read here, bounded: a config or tokenizer config naming
custom code, or a model type chunkgen does not run, is refused by name. The files that say what a
prompt becomes (config, tokenizer, chat template) must lie inside the folder, not behind a link out
of it. The config's sizes are checked against the memory they imply and against the tensors the
weight files hold, before anything is allocated; after the load, every tensor the architecture
needs must have come from the checkpoint with its shape (see `check_loaded`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from chunkgen.bounded import TOKENIZER_CONFIG_BYTES, NotText, TooLarge, read_text
from chunkgen.device import human_bytes

# The model types of the architectures chunkgen runs (model/llama.py's SUPPORTED_ARCHITECTURES).
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma3_text")
# The files that decide what a prompt becomes: read only from inside the folder.
PROMPT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
SHOWN = 3  # tensors named in a refusal


class FolderRefused(ValueError):
    """The folder cannot be trusted as it is; the message names the file and what is wrong."""


def read_json(path: Path, limit: int = TOKENIZER_CONFIG_BYTES) -> dict[str, Any]:
    try:
        data = json.loads(read_text(path, limit, "JSON"))
    except (TooLarge, NotText) as exc:
        raise FolderRefused(str(exc)) from None
    except OSError as exc:
        raise FolderRefused(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise FolderRefused(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FolderRefused(f"{path}: expected a JSON object")
    return data


def _snapshot_root(folder: Path) -> Path | None:
    """The repository's cache folder of a snapshot in the Hugging Face cache, else None."""
    folder = folder.absolute()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return None


def _lands_at(path: Path, snapshot: Path | None) -> Path:
    """Where reading `path` leads: wholly resolved, or for a snapshot's file the blob its link
    names (the cache's own layout; how the cache stores its blobs is the cache's business)."""
    if snapshot is not None and path.is_symlink():
        return Path(os.path.normpath(path.parent.absolute() / os.readlink(path)))
    return path.resolve()


def _check_inside(folder: Path) -> None:
    snapshot = _snapshot_root(folder)
    root = snapshot if snapshot is not None else folder.resolve()
    names = [folder / n for n in PROMPT_FILES]
    templates = folder / "chat_templates"
    if templates.is_symlink() or templates.is_dir():
        names += [templates, *sorted(templates.iterdir())] if templates.is_dir() else [templates]
    for path in names:
        if not (path.exists() or path.is_symlink()):
            continue
        target = _lands_at(path, snapshot)
        if not target.is_relative_to(root):
            raise FolderRefused(
                f"{path} links to {target}, outside the model folder; chunkgen reads a model's "
                "config, tokenizer and chat template only from inside its folder"
            )


def refuse_custom_code(path: Path, data: dict[str, Any]) -> None:
    for key in ("auto_map", "custom_pipelines"):
        if data.get(key):
            named = data[key]
            shown = ", ".join(sorted(named)[:SHOWN]) if isinstance(named, dict) else str(named)[:80]
            raise FolderRefused(
                f"{path} names custom code ({key}: {shown}); chunkgen never runs code from a model "
                "folder (only the architectures it ships are run)"
            )


def check_folder(folder: Path, memory: int | None = None) -> dict[str, Any]:
    """The folder's config.json as data, after the checks above (`memory`: the bytes the weights
    may take at most, the machine's memory when None). Raises FolderRefused."""
    folder = Path(folder)
    _check_inside(folder)
    config = read_json(folder / "config.json", 16 << 20)
    refuse_custom_code(folder / "config.json", config)
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (folder / name).is_file():
            refuse_custom_code(folder / name, read_json(folder / name))
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise FolderRefused(
            f"{folder / 'config.json'}: model_type {model_type!r} (architecture "
            f"{(config.get('architectures') or ['none'])[0]}) is not one chunkgen runs "
            f"({', '.join(SUPPORTED_TYPES)}); a model folder's own code is never run"
        )
    check_sizes(folder / "config.json", config, memory)
    held = checkpoint_elements(folder)
    if held is not None:
        implied = parameters(config)
        if implied > held * 1.05 + (1 << 20):
            raise FolderRefused(
                f"{folder / 'config.json'}: its sizes ({_sizes_text(config)}) make about "
                f"{implied / 1e6:,.1f}M parameters, but the weight files hold {held / 1e6:,.1f}M; "
                "the config does not describe these weights"
            )
    return config


def _language(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _positive(config: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is None:
        raise FolderRefused(f"{path}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FolderRefused(f"{path}: {key} must be a positive integer, not {value!r}")
    return value


def _shape(config: dict[str, Any], path: Path) -> dict[str, int]:
    c = _language(config)
    hidden = _positive(c, "hidden_size", path)
    heads = _positive(c, "num_attention_heads", path)
    return {
        "layers": _positive(c, "num_hidden_layers", path),
        "hidden": hidden,
        "intermediate": _positive(c, "intermediate_size", path),
        "vocab": _positive(c, "vocab_size", path),
        "heads": heads,
        "kv_heads": _positive(c, "num_key_value_heads", path, heads) if c.get("num_key_value_heads") else heads,
        "head_dim": _positive(c, "head_dim", path) if c.get("head_dim") else max(1, hidden // heads),
        "positions": _positive(c, "max_position_embeddings", path, 4096),
        "tied": bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", True))),
    }


def parameters(config: dict[str, Any], path: Path = Path("config.json")) -> int:
    """About how many weights the config's sizes make (projections, embeddings; norms aside)."""
    s = _shape(config, path)
    h, d = s["hidden"], s["head_dim"]
    layer = 2 * h * s["heads"] * d + 2 * h * s["kv_heads"] * d + 3 * h * s["intermediate"]
    return s["layers"] * layer + s["vocab"] * h * (1 if s["tied"] else 2)


def _sizes_text(config: dict[str, Any]) -> str:
    c = _language(config)
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    return ", ".join(f"{k} {c.get(k)}" for k in keys)


def check_sizes(path: Path, config: dict[str, Any], memory: int | None = None) -> None:
    """The memory the config's sizes imply, before anything is allocated: its weights (2 bytes
    each at the least) and its rotary table (the longest context's cos and sin, computed in fp32)
    must fit in `memory` (the machine's memory by default)."""
    if memory is None:
        import psutil

        memory = psutil.virtual_memory().total
    s = _shape(config, path)
    weights = 2 * parameters(config, path)
    if weights > memory:
        raise FolderRefused(
            f"{path}: its sizes ({_sizes_text(config)}) make weights of at least {human_bytes(weights)}, "
            f"more than this machine's {human_bytes(memory)} of memory"
        )
    table = s["positions"] * (s["head_dim"] * 16 + 8)
    if table > memory // 4:
        raise FolderRefused(
            f"{path}: max_position_embeddings {s['positions']:,} makes a rotary table of "
            f"{human_bytes(table)}, more than a quarter of this machine's {human_bytes(memory)} of memory"
        )


HEADER_LIMIT = 100 << 20  # a safetensors header (a JSON index of the tensors): safetensors' own cap


def checkpoint_elements(folder: Path) -> int | None:
    """Elements of every tensor in the folder's safetensors files, read from their headers; None
    when the folder holds none (pickled weights: transformers' own check covers them)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with open(f, "rb") as stream:
                raw = stream.read(8)
                if len(raw) < 8:
                    raise FolderRefused(f"{f}: not a safetensors file (shorter than its header)")
                (n,) = struct.unpack("<Q", raw)
                if n > HEADER_LIMIT or n > f.stat().st_size:
                    raise FolderRefused(f"{f}: not a safetensors file (its header claims {human_bytes(n)})")
                header = json.loads(stream.read(n))
        except OSError as exc:
            raise FolderRefused(f"{f}: cannot read it ({exc.strerror or exc})") from None
        except (ValueError, RecursionError):
            raise FolderRefused(f"{f}: not a safetensors file (its header is not JSON)") from None
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise FolderRefused(f"{f}: tensor {name!r} has no valid shape")
            total += math.prod(shape)
    return total


def _named(keys, what: str) -> str:
    keys = sorted(str(k) for k in keys)
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{what} {', '.join(keys[:SHOWN])}{more}"


def check_loaded(where: str, info: dict[str, Any]) -> None:
    """transformers' loading report, refused when any tensor the architecture needs did not come
    from the checkpoint (it would run with fresh random weights), came with another shape, or the
    checkpoint holds tensors the architecture has no place for (a renamed or mis-converted one)."""
    mismatched = [m[0] if isinstance(m, (tuple, list)) else m for m in info.get("mismatched_keys") or ()]
    shapes = {
        m[0]: f"{tuple(m[1])} in the file, {tuple(m[2])} in the config"
        for m in info.get("mismatched_keys") or ()
        if isinstance(m, (tuple, list)) and len(m) >= 3
    }
    problems = []
    if info.get("missing_keys"):
        problems.append(_named(info["missing_keys"], "missing"))
    if mismatched:
        first = sorted(mismatched)[0]
        extra = f" ({shapes[first]})" if first in shapes else ""
        problems.append(_named(mismatched, "mis-shaped") + extra)
    if info.get("unexpected_keys"):
        problems.append(_named(info["unexpected_keys"], "unexpected"))
    if problems:
        raise FolderRefused(
            f"{where}: the weights do not match the model's config: {'; '.join(problems)}; "
            "chunkgen runs no model with weights missing or out of place"
        )
