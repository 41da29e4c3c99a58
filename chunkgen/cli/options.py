"""Everything a user can get wrong on the command line, checked before the model loads: the
options resolved into one `Config`, the output file, sampling defaults and constraints, the model
folder and its tokenizer. A mistake is one line naming the option (exit 2) or the problem (exit 1)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from chunkgen.cli.boundary import err, fail, usage
from chunkgen.cli.option_types import SAMPLING_OPTIONS
from chunkgen.config import Config, OptionError
from chunkgen.device import human_bytes
from chunkgen.engine.params import KINDS


def refuse(exc: OptionError) -> NoReturn:
    """An OptionError said the way the command line says mistakes."""
    if exc.usage:
        usage(exc.option, exc.message)
    fail(exc.message)


@contextmanager
def said_as_mistakes() -> Iterator[None]:
    """OptionErrors raised by the block (config, job source) end the command in one line."""
    try:
        yield
    except OptionError as exc:
        refuse(exc)


def resolve_config(**options: Any) -> Config:
    """`Config.resolve`, with a slow choice said once as a warning."""
    with said_as_mistakes():
        config = Config.resolve(**options)
    for note in config.notes:
        err.print(f"[yellow]warning:[/] {note}", highlight=False)
    return config


def check_kv_fits(model_dir: Path, config: Config) -> None:
    """The KV budget holds at least one chunk of this model (before its weights load)."""
    import torch

    from chunkgen.cache.forecast import planning_pool

    if config.kv_memory is None:
        return  # auto on a GPU: decided from the memory the weights leave
    # The model's own dtype on a GPU is not known before loading: fp32, the largest, is the bound.
    per_chunk = planning_pool(model_dir, config.chunk_size, config.kv_dtype or torch.float32).bytes_per_slot
    if config.kv_memory < per_chunk:
        usage(
            "--kv-memory",
            f"{human_bytes(config.kv_memory)} holds no KV chunk of this model: one chunk of "
            f"{config.chunk_size} tokens needs {human_bytes(per_chunk)}",
        )


def check_out(out: Path, queries: str) -> None:
    """The output is a regular file this run can append to (or create): a FIFO, a device or a
    folder it cannot write is refused now, not after the model has loaded and answered."""
    import stat as stat_

    if out.is_dir():
        usage("--out", f"{out} is a directory; give a file path, e.g. {out / 'results.jsonl'}")
    try:
        mode = out.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        usage("--out", f"cannot use {out}: {exc.strerror or exc}")
    if mode is not None and not stat_.S_ISREG(mode):
        kind = (
            "a FIFO"
            if stat_.S_ISFIFO(mode)
            else "a device"
            if stat_.S_ISCHR(mode) or stat_.S_ISBLK(mode)
            else "a socket"
            if stat_.S_ISSOCK(mode)
            else "not a regular file"
        )
        usage(
            "--out",
            f"{out} is {kind}; results need a regular file they can be appended to and "
            "rewritten in (resume, the final compaction)",
        )
    if mode is not None and not os.access(out, os.W_OK):
        usage("--out", f"{out} is not writable")
    parent = out.resolve().parent
    if not parent.is_dir():
        usage("--out", f"the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        usage("--out", f"the folder {parent} is not writable (the output is rewritten there at the end of a run)")
    if queries != "-" and out.exists():
        try:
            same = os.path.samefile(out, queries)
        except OSError:
            same = False
        if same:
            usage("--out", f"{out} is the queries file; results go to a file of their own")


def constraint_options(given: dict[str, Any]) -> dict[str, Any]:
    """The constraint among the sampling options (at most one), its file read when the option
    takes a file: --json-schema's parsed, --grammar's as text (compiled later, with the rest)."""
    kinds = [k for k in KINDS if k in given]
    if len(kinds) > 1:
        usage(
            SAMPLING_OPTIONS[kinds[1]],
            f"cannot be combined with {SAMPLING_OPTIONS[kinds[0]]} (give at most one constraint)",
        )
    if not kinds:
        return {}
    from chunkgen.bounded import DuplicateKey, NotText, TooLarge, read_text, unique_keys

    kind = kinds[0]
    value = given[kind]
    if not isinstance(value, Path):
        return {kind: value}
    option = SAMPLING_OPTIONS[kind]
    try:
        text = read_text(value, what="JSON schema" if kind == "json_schema" else "grammar")
    except (TooLarge, NotText) as exc:
        usage(option, str(exc))
    except OSError as exc:
        usage(option, f"cannot read {value} ({exc.strerror or exc})")
    if kind != "json_schema":
        return {kind: text}
    try:
        return {kind: json.loads(text, object_pairs_hook=unique_keys)}
    except DuplicateKey as exc:
        usage(option, f"{value}: {exc}")
    except json.JSONDecodeError as exc:
        usage(option, f"{value} is not valid JSON: {exc}")


def sampling_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """The sampling options and constraint given on the command line (by field), checked: the
    defaults every row's own values are laid over."""
    defaults = {k: v for k, v in given.items() if k not in KINDS and v is not None}
    defaults.update(constraint_options(given))
    check_defaults(defaults)
    return defaults


def check_defaults(defaults: dict[str, Any]) -> None:
    from chunkgen.engine.params import ParamError
    from chunkgen.jobs.requests import check_defaults

    try:
        check_defaults(defaults)
    except ParamError as exc:
        usage(SAMPLING_OPTIONS.get(exc.field, exc.field), exc.message)


def check_tokenizer(templates: dict | None, model_dir: Path, chat_template: bool = True):
    """Before the weights load: the model's tokenizer loads, it has a usable chat template (unless
    --no-chat-template), and no template's own text (system prompt and user message, before any
    row's values) is longer than the model's context, which would fail every row. Returns the
    tokenizer, for the load to take rather than read again."""
    from chunkgen.llm import check_chat_template, encode_prompt
    from chunkgen.model.llama import context_length
    from chunkgen.model.loading import load_tokenizer, model_config

    try:
        tokenizer = load_tokenizer(model_dir)
    except Exception as exc:  # transformers raises ValueError, OSError, or a tokenizer library's own
        fail(
            f"{model_dir}: cannot load the model's tokenizer ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:300]}); a model folder needs its tokenizer files "
            "(tokenizer.json or tokenizer.model, tokenizer_config.json)"
        )
    if not chat_template:
        tokenizer.chat_template = None
    elif not getattr(tokenizer, "chat_template", None):
        fail(
            f"{model_dir}: the model has no chat template, so chat messages cannot be formatted for it; "
            "pass --no-chat-template to send each prompt's messages as plain text joined by blank lines "
            "(for a base model), or use an instruction-tuned model"
        )
    try:
        check_chat_template(tokenizer, str(model_dir))
    except ValueError as exc:
        fail(str(exc))
    if not templates:
        return tokenizer
    context = context_length(model_config(model_dir))
    for t in templates.values():
        n = len(encode_prompt(tokenizer, t.messages({f: "" for f in t.fields})))
        if n >= context:
            fail(
                f"{t.path}: template {t.name!r} is {n} tokens before any row's values, and the model's "
                f"context holds {context} (with room for one generated token); shorten its system prompt "
                "or use a model with a longer context"
            )
    return tokenizer


def resolve_model(model: str | None, config: Config | None = None) -> Path:
    """The model's directory, checked (architecture, weights) without loading any weights; for a
    GGUF whose run (`config`) takes float weights, its float copy made first, said as it is."""
    from chunkgen.model import ModelNotFound, check_model_dir, resolve_model, stale_copies
    from chunkgen.model.loading import copy_size, float_weights
    from chunkgen.model.quant import needs_float_weights

    def notice(gguf: Path, target: Path, size: int | None, floats: bool) -> None:
        if size is None and floats:
            why = "on the GPU" if config is not None and config.device != "cpu" else "with --quantize none"
            err.print(
                f"{gguf.name} runs in floats {why}: converting it once to full-precision weights in {target} "
                "(later runs load that copy)",
                highlight=False,
            )
            return
        if size is None:
            err.print(
                f"first use of {gguf.name}: reading its config and tokenizer once into {target} "
                "(the weights are read from the file itself)",
                highlight=False,
            )
            return
        made = "converted" if floats else "prepared"
        err.print(f"{made}: {human_bytes(size)} in {target} (set CHUNKGEN_CACHE to keep it elsewhere)", highlight=False)
        for old in stale_copies(target):
            err.print(
                f"an older copy of this model (from an earlier version of the file or of chunkgen) "
                f"takes {human_bytes(copy_size(old))}: {old} (remove it with: rm -r '{old}')",
                highlight=False,
            )

    try:
        path = resolve_model(model, on_convert=notice)
        check_model_dir(path)
        if config is not None and needs_float_weights(config.quantize, config.device):
            float_weights(path, on_convert=notice)
    except ModelNotFound as exc:
        fail(str(exc))
    return path
