"""Loading the model for a command: a line when loading starts (a spinner on a terminal) and one
when it ends, and the line that says the dtype, device and KV budget chosen, with why."""

from __future__ import annotations

import time
from pathlib import Path

from chunkgen.cli.boundary import TTY, err, fail
from chunkgen.cli.progress import json_event
from chunkgen.config import Config
from chunkgen.device import human_bytes


def load_llm(config: Config, announce: str = "line", tokenizer=None):
    """The LLM for `config` (`announce`: "line", "json" for --json-log, "none" for --quiet);
    `tokenizer`: the model's, already loaded by a check."""
    from chunkgen.llm import LLM
    from chunkgen.model import ModelNotFound, UnsupportedModel, display_name

    if config.dummy_weights:
        what = f"random weights of {config.dummy_weights}"
    else:
        what = display_name(Path(config.model)) if config.model else "the default model"
    asked = "auto" if "dtype" in config.auto else config.dtype_name
    detail = f"{asked}, {config.device}" + ("" if config.quantize == "none" else f", --quantize {config.quantize}")
    t0 = time.perf_counter()
    try:
        if announce == "json":
            json_event({"event": "model_loading", "model": what})
        elif announce == "line" and not TTY:
            err.print(f"loading {what} ({detail})…", highlight=False)
        if announce == "line" and TTY:
            with err.status(f"loading {what} ({detail})…"):
                llm = LLM(config=config, tokenizer=tokenizer)
        else:
            llm = LLM(config=config, tokenizer=tokenizer)
    except (ModelNotFound, UnsupportedModel, ValueError) as exc:
        fail(str(exc))
    seconds = time.perf_counter() - t0
    if announce == "json":
        json_event({"event": "model_loaded", "model": what, "seconds": round(seconds, 2)})
    elif announce == "line":
        weights = weights_text(llm)
        err.print(f"loaded {what} in {seconds:.1f} s" + (f"; {weights}" if weights else ""), highlight=False)
    return llm


def weights_text(llm) -> str:
    """What the linear layers run on, for the load line and the summary ('' for a float checkpoint,
    whose dtype says it all)."""
    from chunkgen.model.loading import SOURCE_FILE

    if llm.quantized != "none":
        return f"quantized linear layers: {llm.quantized}"
    if llm.model_path is None or not (Path(llm.model_path) / SOURCE_FILE).is_file():
        return ""
    where = "on the GPU" if llm.device != "cpu" else "(--quantize none)"
    return f"GGUF weights dequantized to {llm.config.dtype_name} {where}"


def device_text(config: Config) -> str:
    return f"{config.device} ({config.why['device']})"


def dtype_text(config: Config) -> str:
    return f"{config.dtype_name} ({config.why['dtype']})"


def kv_text(config: Config) -> str:
    """The budget and why, and the K/V dtype where it is not the model's (--kv-dtype)."""
    from chunkgen.model.precision import DTYPE_NAMES

    own = "" if config.kv_dtype in (None, config.dtype) else f" of {DTYPE_NAMES[config.kv_dtype]} K/V"
    return f"{human_bytes(config.kv_memory)}{own} ({config.why['kv_memory']})"


def invariance_text(config: Config) -> str:
    """Whether a row's answer depends on the rows run beside it, and why (docs/batch-invariance.md)."""
    if not config.batch_invariant:
        if "batch_invariant" in config.auto:
            return "off on the GPU by default (--batch-invariant on): answers may differ with the batch near ties"
        return "off (--batch-invariant off): answers may differ with the batch near ties"
    return "on: a row's answer and logprobs do not depend on the rows beside it"


def dtype_line(config: Config) -> str:
    """The dtype and device a loaded model runs on and its KV budget, said once on stderr with why;
    returns the dtype's short name."""
    err.print(f"dtype {dtype_text(config)}; device {device_text(config)}; KV budget {kv_text(config)}", highlight=False)
    return config.dtype_name
