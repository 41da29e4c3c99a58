"""The command line: wiring and printing only; the work lives in jobs/, engine/ and bench/."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree
from typer.core import TyperGroup

try:  # typer 0.2x carries its own copy of click
    from typer._click import exceptions as click_exc
except ImportError:  # older typer: click itself
    from click import exceptions as click_exc


def _abort_classes() -> tuple[type[BaseException], ...]:
    """Every `Abort` the installed typer / click may raise (it moved between their versions; a
    name that is missing in one of them must not break the handler that names it)."""
    import importlib

    found: list[type[BaseException]] = []
    for module in ("typer.exceptions", "typer._click.exceptions", "click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), "Abort", None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in found:
            found.append(cls)
    return tuple(found)


_ABORT = _abort_classes()
_NO_ARGS_HELP = getattr(click_exc, "NoArgsIsHelpError", None)  # click 8.2 and later


# True when the command is the whole process (the `chunkgen` entry point): the handlers a run installs
# then stay until it exits, so a signal during the last lines of output or the exit is never a traceback.
_PROCESS_EXITS_AFTER = False


class _Interrupted(Exception):
    """SIGINT (KeyboardInterrupt) inside a command, carried past typer's and click's own handlers,
    which turn it into a silent exit code (typer) or an Abort (click), so that it is said in one line."""

_TTY = sys.stderr.isatty()
# transformers' own warnings (a config field it finds odd) would come between chunkgen's lines; its
# errors still show, and TRANSFORMERS_VERBOSITY=warning brings the rest back.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _usage_error_text(e: click_exc.ClickException) -> str:
    """A usage error in the words of a run error: `error: --option: what is wrong`."""
    if isinstance(e, click_exc.BadParameter) and not isinstance(e, click_exc.MissingParameter):
        hint = e.param_hint if e.param_hint is not None else getattr(e.param, "opts", None)
        if isinstance(hint, (list, tuple)):
            hint = " / ".join(hint)
        text = _value_error_text(e.__cause__) or _click_value_text(e.message) or e.message
        message = f"{hint.replace(chr(39), '')}: {text}" if hint else text
    else:
        message = e.format_message()
        message = message[:1].lower() + message[1:]
    ctx = getattr(e, "ctx", None)
    where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    return message.rstrip(".") + where


def _click_value_text(message: str) -> str | None:
    """click 8.1's type and range messages (older typer parses with click itself), in the same words
    as _value_error_text gives newer typer's."""
    import re

    message = message.strip().removesuffix(".")
    m = re.fullmatch(r"'?(.*?)'? is not a valid (integer|float)( range)?", message)
    if m:
        return f"must be {'an integer' if m[2] == 'integer' else 'a number'}, not {m[1]!r}"
    m = re.fullmatch(r"(\S+) is not in the range (?:(\S+)<=)?x(?:<=(\S+))?", message)
    if m:
        value, low, high = m[1], m[2], m[3]
        if low is not None and high is not None:
            return f"must be between {low} and {high}, not {value}"
        return f"must be at least {low}, not {value}" if low is not None else f"must be at most {high}, not {value}"
    m = re.fullmatch(r"(\S+) is not in the range x>=(\S+)", message)
    if m:
        return f"must be at least {m[2]}, not {m[1]}"
    return None


def _value_error_text(cause: BaseException | None) -> str | None:
    """A type or range error of an option's value, in the words of chunkgen's own checks."""
    errors = getattr(cause, "errors", None)
    if not callable(errors):
        return None
    first = errors()[0]
    kind, value, limits = first.get("type"), first.get("input"), first.get("ctx") or {}
    if kind == "int_parsing":
        return f"must be an integer, not {value!r}"
    if kind == "float_parsing":
        return f"must be a number, not {value!r}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        words = {"greater_than_equal": "at least", "less_than_equal": "at most",
                 "greater_than": "more than", "less_than": "less than"}[kind]
        bound = next(iter(limits.values()), "?")
        return f"must be {words} {bound}, not {value}"
    return None


class _Group(TyperGroup):
    """The CLI's one exception boundary: usage errors (exit code 2) print one line in the same form
    as run errors (exit code 1); an interrupt, a full disk or any unexpected error is one line too,
    never a traceback (CHUNKGEN_TRACEBACK=1 shows it, for a bug report)."""

    # typer turns an interrupt inside parsing or a command into a silent exit 130: both are caught
    # first, so that it is said in one line.
    def make_context(self, *args: Any, **kwargs: Any):
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            raise _Interrupted() from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra: Any):
        saved = {s: signal.getsignal(s) for s in EXIT_SIGNAL}
        try:
            return self._main(args, prog_name, complete_var, standalone_mode, **extra)
        finally:
            if not _PROCESS_EXITS_AFTER:  # the process goes on (a test's): its own handlers back
                for s, h in saved.items():
                    signal.signal(s, h)

    def _main(self, args, prog_name, complete_var, standalone_mode, **extra: Any):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exc.ClickException as e:
            if _NO_ARGS_HELP is not None and isinstance(e, _NO_ARGS_HELP):  # a bare `chunkgen`: the help
                e.show()
                sys.exit(e.exit_code)
            err.print(f"[bold red]error:[/] {escape(_one_line(_usage_error_text(e)))}", highlight=False)
            sys.exit(e.exit_code)
        except (_Interrupted, KeyboardInterrupt):
            err.print("interrupted (SIGINT); nothing was written after it", highlight=False)
            sys.exit(EXIT_SIGNAL[signal.SIGINT])
        except BaseException as e:
            if isinstance(e, SystemExit) or os.environ.get("CHUNKGEN_TRACEBACK"):
                raise
            if _ABORT and isinstance(e, _ABORT):
                err.print("aborted", highlight=False)
            elif not isinstance(e, Exception):
                raise
            else:
                err.print(f"[bold red]error:[/] {escape(_unexpected_text(e))}", highlight=False)
            sys.exit(EXIT_ERROR)
        sys.exit(code if isinstance(code, int) else 0)


def _unexpected_text(e: BaseException) -> str:
    """An error no check foresaw, in one line: a full disk or an unwritable temporary folder in
    the user's words, anything else by its type and message, with how to see where it came from."""
    import errno
    import tempfile

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
        if e.filename is None or str(e.filename).startswith(tempfile.gettempdir()):
            return (f"cannot write the temporary folder {tempfile.gettempdir()} (TMPDIR): {e.strerror}; free "
                    "space there or set TMPDIR to a writable folder with room")
        return f"cannot write {e.filename}: {e.strerror}"
    text = " ".join(str(e).split()) or "(no message)"
    return (f"unexpected {type(e).__name__}: {text[:400]} (run again with CHUNKGEN_TRACEBACK=1 for the "
            "traceback, and report it)")


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  rich_markup_mode="rich" if _TTY else None,  # plain, unwrapped messages in logs and CI
                  help="Offline batched generation on a prefix-aware chunked KV cache.")
bench_app = typer.Typer(cls=_Group, no_args_is_help=True, help="Benchmarks: the attention kernel, end to end.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True, soft_wrap=not _TTY)
stdout = Console(width=None if sys.stdout.isatty() else 160)  # tables stay readable when piped

# Exit codes: 0 done; 1 an error (message, no traceback); 2 a usage error (a bad option, as typer);
# 3 some rows became error records; 130 / 143 stopped by SIGINT / SIGTERM (resumable).
EXIT_ERROR = 1
EXIT_BAD_INPUT_LINES = 3
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
PROGRESS_EVERY_S = 10.0  # plain progress lines outside a terminal
JSON_PROGRESS_EVERY_S = 1.0


def _one_line(text: str) -> str:
    """A message as one line: a library's multi-line error (a parser's caret diagram) joined up."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _fail(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {_one_line(message)}", highlight=False, markup=True)
    raise typer.Exit(EXIT_ERROR)


def _usage(option: str, message: str) -> NoReturn:
    raise typer.BadParameter(message, param_hint=f"'{option}'")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _version(value: bool) -> None:
    if value:
        from chunkgen import __version__

        print(f"chunkgen {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Offline batched generation on a prefix-aware chunked KV cache."""


# -- checks that run before anything is loaded ------------------------------------------------------
def _check_queries(queries: str) -> None:
    if queries == "-":
        return
    path = Path(queries)
    if path.is_dir():
        _usage("--queries", f"{path} is a directory; give a JSONL file (or - for standard input)")
    if not path.exists():
        _usage("--queries", f"{path}: queries file not found")


def _check_out(out: Path, queries: str) -> None:
    """The output is a regular file this run can append to (or create): a FIFO, a device or a
    folder it cannot write is refused now, not after the model has loaded and answered."""
    import stat as stat_

    if out.is_dir():
        _usage("--out", f"{out} is a directory; give a file path, e.g. {out / 'results.jsonl'}")
    try:
        mode = out.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        _usage("--out", f"cannot use {out}: {exc.strerror or exc}")
    if mode is not None and not stat_.S_ISREG(mode):
        kind = "a FIFO" if stat_.S_ISFIFO(mode) else "a device" if stat_.S_ISCHR(mode) or stat_.S_ISBLK(mode) \
            else "a socket" if stat_.S_ISSOCK(mode) else "not a regular file"
        _usage("--out", f"{out} is {kind}; results need a regular file they can be appended to and "
                        "rewritten in (resume, the final compaction)")
    if mode is not None and not os.access(out, os.W_OK):
        _usage("--out", f"{out} is not writable")
    parent = out.resolve().parent
    if not parent.is_dir():
        _usage("--out", f"the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        _usage("--out", f"the folder {parent} is not writable (the output is rewritten there at the end of a run)")
    if queries != "-" and out.exists():
        try:
            same = os.path.samefile(out, queries)
        except OSError:
            same = False
        if same:
            _usage("--out", f"{out} is the queries file; results go to a file of their own")


def _check_format(fmt: str) -> None:
    if fmt not in ("auto", "template", "openai"):
        _usage("--format", f"must be auto, template or openai, not {fmt!r}")


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 16 or chunk_size % 16:
        _usage("--chunk-size", f"must be a multiple of 16 (16, 32, 64, ...), not {chunk_size}")


def _dtype_option(dtype: str, device: str = "cpu"):
    """The dtype --dtype names on this device (auto resolved; None: the model's own, on a GPU)."""
    from chunkgen.model.precision import choose_dtype

    try:
        return choose_dtype(dtype, device).dtype
    except ValueError as exc:
        _usage("--dtype", str(exc) + " or auto")


def _check_device(device: str):
    """The device --device names on this machine (auto resolved), with why: a DeviceChoice."""
    from chunkgen.device import check_device_name, choose_device, detect

    try:
        check_device_name(device)
    except ValueError as exc:
        _usage("--device", str(exc))
    try:
        return choose_device(device, detect())
    except ValueError as exc:
        _fail(str(exc))


def _max_batch_option(value: str) -> int:
    """--max-batch as the engine takes it (auto resolved); a bad value is a usage error."""
    from chunkgen.device import choose_max_batch

    try:
        return choose_max_batch(value).rows
    except ValueError as exc:
        _usage("--max-batch", str(exc))


def _max_batch_values(value: str) -> str:
    """Checks --max-batch (one value or several, comma-separated) while the options are parsed."""
    for part in value.split(","):
        _max_batch_option(part)
    return value


def _check_engine_options(dtype: str, device: str, chunk_size: int, kv_memory: str) -> int | None:
    """Validates dtype, chunk size and the KV budget's format on a chosen device (cpu, cuda:N);
    returns the budget in bytes, or None for auto on a GPU (decided once the weights are loaded)."""
    import torch

    from chunkgen.device import choose_kv_memory

    kv_dtype = _dtype_option(dtype, device)
    if not device.startswith("cuda") and kv_dtype == torch.float16:
        err.print("[yellow]warning:[/] --dtype fp16 on the CPU runs several times slower than fp32 or bf16; "
                  "fp16 is for --device cuda", highlight=False)
    _check_chunk_size(chunk_size)
    if kv_memory.strip().lower() == "auto" and device.startswith("cuda"):
        return None
    try:
        budget = choose_kv_memory(kv_memory, device).bytes
    except ValueError as exc:
        _usage("--kv-memory", str(exc) + " or auto")
    if budget <= 0:
        _usage("--kv-memory", f"must be positive, not {kv_memory!r}")
    if not device.startswith("cuda"):
        import psutil

        total = psutil.virtual_memory().total
        if budget > total:
            _usage("--kv-memory", f"{_human(budget)} is more than this machine's memory ({_human(total)}); "
                                  "on the CPU the budget is a cap used as chunks fill, so give at most that")
    return budget


SAMPLING_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "top_k": "--top-k", "seed": "--seed", "stop": "--stop", "logprobs": "--logprobs",
                    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                    "json_schema": "--json-schema",
                    "regex": "--regex", "grammar": "--grammar"}


def _constraint_options(json_schema: Optional[Path], regex: Optional[str], grammar: Optional[Path]) -> dict[str, Any]:
    """--json-schema / --regex / --grammar as sampling defaults (files read, not yet compiled)."""
    given = [o for o, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        _usage(given[1], f"cannot be combined with {given[0]} (give at most one constraint)")
    if regex is not None:
        return {"regex": regex}
    option, path = ("--json-schema", json_schema) if json_schema is not None else ("--grammar", grammar)
    if path is None:
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _usage(option, f"cannot read {path} ({getattr(exc, 'strerror', None) or exc})")
    if option == "--grammar":
        return {"grammar": text}
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as exc:
        _usage(option, f"{path} is not valid JSON: {exc}")


def _check_defaults(defaults: dict[str, Any]) -> None:
    from chunkgen.engine.sampler import ParamError
    from chunkgen.jobs.requests import check_defaults

    try:
        check_defaults(defaults)
    except ParamError as exc:
        _usage(SAMPLING_OPTIONS.get(exc.field, exc.field), exc.message)


def _check_order(order: str) -> None:
    if order not in ("prefix", "input"):
        _usage("--order", f"must be prefix or input, not {order!r}")


def _read_items(queries: str, template: Optional[Path], fmt: str, defaults: dict[str, Any], id_field: str,
                prefix_order: bool = False):
    """(format, iterator of Job | ErrorRecord, templates, PrefixOrder or None) over the query file;
    a bad template stops here. With `prefix_order`, the rows can be read again by offset (standard
    input is spooled to a temporary file for that)."""
    from chunkgen.jobs.order import PrefixOrder, RowFile
    from chunkgen.jobs.requests import detect_format, open_queries, openai_jobs, read_rows, template_jobs
    from chunkgen.jobs.templates import TemplateError, load_templates

    from chunkgen.jobs.whole_file import FileMistake, check_sample

    templates = None
    if template is not None:
        try:
            templates = load_templates(template)
        except TemplateError as exc:
            _fail(str(exc))
    if queries != "-" and Path(queries).is_file():
        try:
            check_sample(Path(queries), fmt, templates, id_field)
        except FileMistake as exc:
            _usage("--queries", str(exc))
        except OSError as exc:
            _fail(f"{queries}: cannot read the queries file ({exc.strerror})")
    try:
        row_file = RowFile(queries) if prefix_order else None
        stream = row_file.lines() if row_file else open_queries(queries)
    except OSError as exc:
        _fail(f"{queries}: cannot read the queries file ({exc.strerror})")
    rows = read_rows(stream)
    if fmt == "auto":
        fmt, rows = detect_format(rows)
    if fmt == "openai":
        templates = {}

        def to_jobs(rows):
            return openai_jobs(rows, defaults)
    elif templates is None:
        _fail(f"{queries} holds template rows: pass --template (a .toml file or a directory of them)")
    else:
        def to_jobs(rows):
            return template_jobs(rows, templates, defaults, id_field)
    if row_file is None:
        return fmt, to_jobs(rows), templates, None
    order, items = PrefixOrder.reading(row_file, rows, to_jobs)
    return fmt, items, templates, order


def _csv_as_jsonl(queries: str) -> str:
    """A .csv queries file (header row = field names) as the JSONL file the run reads: written once
    to the temporary folder, removed when the process ends."""
    if queries == "-" or Path(queries).suffix.lower() != ".csv" or not Path(queries).is_file():
        return queries
    import tempfile

    from chunkgen.jobs.whole_file import csv_to_jsonl

    folder = tempfile.TemporaryDirectory(prefix="chunkgen-csv-")
    _KEEP.append(folder)
    target = Path(folder.name) / (Path(queries).stem + ".jsonl")
    try:
        csv_to_jsonl(Path(queries), target)
    except UnicodeDecodeError as exc:
        _usage("--queries", f"{queries}: not UTF-8 text (byte {exc.start}); save the CSV as UTF-8")
    except OSError as exc:
        _fail(_unexpected_text(exc))
    except Exception as exc:  # csv.Error: e.g. a field larger than the csv module takes
        _usage("--queries", f"{queries}: cannot be read as CSV ({exc})")
    return str(target)


_KEEP: list = []  # temporary folders that live as long as the process


def _check_tmpdir(queries: str, ordering: bool) -> None:
    """The temporary folder the run writes to (standard input spooled and the prefix order's sorted
    runs), usable and with room for what this input needs, before the model loads."""
    import shutil
    import tempfile

    if not ordering:
        return
    named = os.environ.get("TMPDIR")
    if named and not os.path.isdir(named):
        _fail(f"TMPDIR={named} is not a folder; create it or set TMPDIR to a writable folder")
    try:
        folder = tempfile.gettempdir()
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        _fail(f"the temporary folder {named or '(TMPDIR)'} cannot be written ({exc.strerror or exc}); set TMPDIR "
              "to a writable folder")
    if named and os.path.realpath(folder) != os.path.realpath(named):
        _fail(f"TMPDIR={named} cannot be written; set TMPDIR to a writable folder")
    from chunkgen.jobs.order import sort_bytes_needed

    needed = sort_bytes_needed(_count_lines(queries) or 0)
    free = shutil.disk_usage(folder).free
    if needed > free:
        _fail(f"the temporary folder {folder} (TMPDIR) has {_human(free)} free and --order prefix needs about "
              f"{_human(needed)} there for this file's sort keys; free space there, set TMPDIR to a folder "
              "with room, or pass --order input")


def _check_not_empty(queries: str) -> None:
    """A queries file without a single row is a mistake worth a word (standard input is checked at the end)."""
    if queries == "-" or not Path(queries).is_file():
        return
    with open(queries, "rb") as f:
        if not any(line.strip() for line in f):
            _fail(f"{queries} holds no rows (it is empty or blank); nothing to run")


def _check_tokenizer(templates: dict | None, model_dir: Path, chat_template: bool = True) -> None:
    """Before the weights load: the model's tokenizer loads, it has a usable chat template (unless
    --no-chat-template), and no template's own text (system prompt and user message, before any
    row's values) is longer than the model's context, which would fail every row."""
    from transformers import AutoConfig, AutoTokenizer

    from chunkgen.llm import check_chat_template, encode_prompt
    from chunkgen.model.llama import context_length

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises ValueError, OSError, or a tokenizer library's own
        _fail(f"{model_dir}: cannot load the model's tokenizer ({type(exc).__name__}: "
              f"{' '.join(str(exc).split())[:300]}); a model folder needs its tokenizer files "
              "(tokenizer.json or tokenizer.model, tokenizer_config.json)")
    if not chat_template:
        tokenizer.chat_template = None
    elif not getattr(tokenizer, "chat_template", None):
        _fail(f"{model_dir}: the model has no chat template, so chat messages cannot be formatted for it; "
              "pass --no-chat-template to send each prompt's messages as plain text joined by blank lines "
              "(for a base model), or use an instruction-tuned model")
    try:
        check_chat_template(tokenizer, str(model_dir))
    except ValueError as exc:
        _fail(str(exc))
    if not templates:
        return
    context = context_length(AutoConfig.from_pretrained(model_dir))
    for t in templates.values():
        n = len(encode_prompt(tokenizer, t.messages({f: "" for f in t.fields})))
        if n >= context:
            _fail(f"{t.path}: template {t.name!r} is {n} tokens before any row's values, and the model's "
                  f"context holds {context} (with room for one generated token); shorten its system prompt "
                  "or use a model with a longer context")


def _count_lines(queries: str) -> int | None:
    """Rows in the file for the progress total (a pipe cannot be counted ahead)."""
    if queries == "-" or not Path(queries).is_file():
        return None
    n, last = 0, b"\n"
    with open(queries, "rb") as f:
        while block := f.read(1 << 20):
            n, last = n + block.count(b"\n"), block[-1:]
    return n + (last != b"\n")


def _resolve(model: Optional[str]) -> Path:
    """The model's directory, checked (architecture, weights) without loading any weights."""
    from chunkgen.model import ModelNotFound, check_model_dir, resolve_model, stale_copies
    from chunkgen.model.loading import copy_size

    def notice(gguf: Path, target: Path, size: int | None) -> None:
        if size is None:
            err.print(f"first use of {gguf.name}: converting it once to full-precision weights in {target} "
                      "(later runs load that copy)", highlight=False)
            return
        err.print(f"converted: {_human(size)} in {target} (set CHUNKGEN_CACHE to keep it elsewhere)",
                  highlight=False)
        for old in stale_copies(target):
            err.print(f"an older copy of this model (from an earlier version of the file or of chunkgen) "
                      f"takes {_human(copy_size(old))}: {old} (remove it with: rm -r '{old}')", highlight=False)

    try:
        path = resolve_model(model, on_convert=notice)
        check_model_dir(path)
    except ModelNotFound as exc:
        _fail(str(exc))
    return path


def _planning_pool(model_dir: Path, chunk_size: int, kv_dtype, budget: int = 1 << 62):
    """A ChunkPool with bookkeeping only, shaped like the model's KV cache (for sizes and plans)."""
    from transformers import AutoConfig

    from chunkgen.cache import ChunkPool

    return ChunkPool.for_config(AutoConfig.from_pretrained(model_dir), chunk_size, kv_dtype,
                                budget_bytes=budget, storage=False)


def _check_budget(model_dir: Path, chunk_size: int, dtype: str, device: str, budget: int) -> None:
    import torch

    # The model's own dtype on a GPU is not known before loading: fp32, the largest, is the bound.
    kv_dtype = _dtype_option(dtype, device) or torch.float32
    if device == "cpu" and kv_dtype == torch.float16:
        kv_dtype = torch.float32  # the CPU kernel keeps fp16 models' K/V in fp32
    per_chunk = _planning_pool(model_dir, chunk_size, kv_dtype).bytes_per_slot
    if budget < per_chunk:
        _usage("--kv-memory", f"{_human(budget)} holds no KV chunk of this model: one chunk of {chunk_size} "
                              f"tokens needs {_human(per_chunk)}")


def _dtype_line(llm) -> str:
    """The dtype and device a loaded model runs on and its KV budget, said once on stderr with why;
    returns the dtype's short name."""
    from chunkgen.model.precision import DTYPE_NAMES

    name = DTYPE_NAMES.get(llm.model.dtype, str(llm.model.dtype))
    err.print(f"dtype {name} ({llm.dtype_reason}); {_device_text(llm)}; KV budget {_kv_text(llm)}", highlight=False)
    return name


def _device_text(llm) -> str:
    return f"device {llm.device} ({llm.device_choice.reason})"


def _kv_text(llm) -> str:
    return f"{_human(llm.kv_budget.bytes)} ({llm.kv_budget.reason})"


def _load_llm(model: Optional[str], announce: str = "line", **kwargs):
    """The LLM, with a line when loading starts and one when it ends (`announce`: "line", "json" for
    --json-log, "none" for --quiet); on a terminal a spinner stands for the first line."""
    from chunkgen.llm import LLM
    from chunkgen.model import ModelNotFound, UnsupportedModel, display_name

    if kwargs.get("dummy_weights"):
        what = f"random weights of {kwargs['dummy_weights']}"
    else:
        what = display_name(Path(model)) if model else "the default model"
    detail = f"{kwargs.get('dtype', 'auto')}, {_check_device(kwargs.get('device', 'auto')).device}"
    t0 = time.perf_counter()
    try:
        if announce == "json":
            _json_event({"event": "model_loading", "model": what})
        elif announce == "line" and not _TTY:
            err.print(f"loading {what} ({detail})…", highlight=False)
        if announce == "line" and _TTY:
            with err.status(f"loading {what} ({detail})…"):
                llm = LLM(model=model, **kwargs)
        else:
            llm = LLM(model=model, **kwargs)
    except (ModelNotFound, UnsupportedModel, ValueError) as exc:
        _fail(str(exc))
    seconds = time.perf_counter() - t0
    if announce == "json":
        _json_event({"event": "model_loaded", "model": what, "seconds": round(seconds, 2)})
    elif announce == "line":
        err.print(f"loaded {what} in {seconds:.1f} s", highlight=False)
    return llm


def _json_event(event: dict) -> None:
    print(json.dumps(event), file=sys.stderr, flush=True)


class _Ticker:
    """Calls `tick()` every `every_s` from a daemon thread until stopped. One engine step (a long
    prefill wave) or one bench round holds the main thread for minutes; this keeps lines coming."""

    def __init__(self, tick, every_s: float = 1.0) -> None:
        self._tick = tick
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chunkgen-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            self._tick()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _StopFlag:
    """SIGINT / SIGTERM ask the run to stop after the current step; a second one stops at once.

    Stopping at once raises KeyboardInterrupt in the main thread, so the writer closes without the
    final rewrite. Raised wherever the main thread happens to be, it can land in a generator's cleanup
    or a finaliser and be swallowed ("Exception ignored"); so the second signal also arms a timer
    that, unless the run has stopped by then (`settle`), exits the process. Nothing is lost by that
    exit: every record was written whole by one system call, the lock goes with the process, and a
    rewrite's copy left behind is removed by the next --resume."""

    GRACE_S = 3.0

    def __init__(self, out: Path | None = None) -> None:
        self.signum: int | None = None
        self._out = out
        self._timer: threading.Timer | None = None
        self._old = {s: signal.signal(s, self._handle) for s in EXIT_SIGNAL}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        if self._timer is None:
            self._timer = threading.Timer(self.GRACE_S, self._exit_now)
            self._timer.daemon = True
            self._timer.start()
        raise KeyboardInterrupt

    def _exit_now(self) -> None:
        where = f" to {self._out}" if self._out is not None else ""
        message = (f"stopped at once by a second signal: every record written{where} is whole; run the "
                   "same command with --resume to continue\n")
        try:
            os.write(2, message.encode())
        finally:
            os._exit(EXIT_SIGNAL[self.signum or signal.SIGINT])

    def settle(self) -> None:
        """The run has stopped: no exit from the timer."""
        if self._timer is not None:
            self._timer.cancel()

    def __call__(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        """The run is over: a signal from now on (while the summary prints, while the process exits)
        has nothing left to stop; it is noted, never raised. The boundary puts the handlers that were
        there before back when the command returns (in a process that goes on, e.g. a test's)."""
        self.settle()
        for s in self._old:
            signal.signal(s, self._late)

    def _late(self, signum, frame) -> None:
        self.signum = self.signum or signum


def _progress_text(p) -> str:
    rate = p.generated_tokens / p.elapsed_s if p.elapsed_s else 0.0
    return (f"{rate:6.1f} tok/s  batch {p.running:3d}  KV {_human(p.kv_used_bytes)}  "
            f"cache hits {100 * p.cache_hit_rate:4.1f}%")


def _progress_lines(json_log: bool, total: int | None):
    """Lines from the job's progress callback (after each engine step) and, when no step has ended
    for a while, from a ticker that says which step is running and for how long."""
    every = JSON_PROGRESS_EVERY_S if json_log else PROGRESS_EVERY_S
    lock = threading.Lock()
    t0 = time.perf_counter()
    state: dict[str, Any] = {"p": None, "at": t0, "printed": float("-inf")}

    def emit(p, now: float) -> None:
        busy = now - state["at"]  # since the last step ended (or the run began)
        elapsed = now - t0
        if json_log:
            fields = dict(p.__dict__) if p is not None else {"done": 0, "total": total}
            _json_event({"event": "progress", **fields, "elapsed_s": round(elapsed, 2),
                         "step_running_s": round(busy, 2)})
        else:
            if p is None:
                of = f"/{total}" if total else ""
                line = f"progress: 0{of} rows done, {elapsed:.0f} s, first prefill wave running for {busy:.0f} s"
            else:
                of = f"/{p.total}" if p.total else ""
                line = f"progress: {p.done}{of} rows done, {p.errors} errors, {elapsed:.0f} s, {_progress_text(p)}"
                if busy >= every:
                    line += f", a step running for {busy:.0f} s"
            print(line, file=sys.stderr, flush=True)
        state["printed"] = now

    def on_step(p) -> None:
        with lock:
            now = time.perf_counter()
            state["p"], state["at"] = p, now
            if now - state["printed"] >= every:
                emit(p, now)

    def tick() -> None:
        with lock:
            now = time.perf_counter()
            if now - state["printed"] >= every and now - t0 >= every:
                emit(state["p"], now)

    ticker = _Ticker(tick, min(1.0, every / 4))
    return on_step, ticker.stop


def _progress_printer(quiet: bool, json_log: bool, total: int | None):
    """(callback, stop) for progress: a bar on a terminal; elsewhere plain (or JSON) lines at least
    every PROGRESS_EVERY_S (JSON_PROGRESS_EVERY_S), also while one long step is running."""
    if quiet:
        return None, lambda: None
    if json_log or not _TTY:
        return _progress_lines(json_log, total)
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=err, transient=False,
    )
    progress.start()
    task = progress.add_task("run", total=None, info="")

    def on_bar(p) -> None:
        progress.update(task, completed=p.done, total=p.total, info=_progress_text(p))
    return on_bar, progress.stop


@app.command()
def run(
    queries: str = typer.Option(..., "--queries", "-q", metavar="FILE", help="JSONL queries or an OpenAI batch file; - reads standard input."),
    out: Path = typer.Option(..., "--out", "-o", metavar="FILE", help="Results JSONL (one line per finished request)."),
    template: Optional[Path] = typer.Option(None, "--template", "-t", metavar="PATH", help="A .toml template or a directory of them."),
    model: Optional[str] = typer.Option(None, metavar="MODEL", help="A Hugging Face model directory, a .gguf file, or a repo id (org/name) in the local Hugging Face cache; never downloaded [default: the embedded SmolLM2-135M-Instruct]."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="Weights and activations: fp32, bf16 (fp16 on GPU) or auto: bf16 on a CPU with native bf16 arithmetic (AVX512_BF16 or AMX), fp32 on other CPUs, the model's own dtype on a GPU."),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda or cuda:N; auto: the GPU when torch sees one and chunkgen's CUDA kernels are built, else the CPU."),
    max_new_tokens: Optional[int] = typer.Option(None, metavar="N", help="Tokens to generate at most per answer [default: 64]."),
    temperature: Optional[float] = typer.Option(None, metavar="X", help="Sampling temperature; 0 is greedy [default: 0]."),
    top_p: Optional[float] = typer.Option(None, metavar="X", help="Nucleus sampling: keep the smallest set of tokens whose probability reaches this, in (0, 1] [default: 1]."),
    top_k: Optional[int] = typer.Option(None, metavar="N", help="Sample among the k most likely tokens; 0 is off [default: 0]."),
    seed: Optional[int] = typer.Option(None, metavar="N", help="Seed for sampling, in [0, 2^63): the same seed gives the same answer in any batch [default: random]."),
    stop: Optional[list[str]] = typer.Option(None, metavar="TEXT", help="Stop string, repeatable: the answer ends before it [default: none]."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", metavar="N", help="Return each generated token's log-probability and its N most likely alternatives, N in [0, 20] [default: none]."),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", metavar="X", help="Subtracted from the logit of every token already generated, in [-2, 2] [default: 0]."),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", metavar="X", help="Subtracted from a token's logit once per time it was generated, in [-2, 2] [default: 0]."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", metavar="FILE", help="Constrain answers to this JSON schema (a .json file) [default: none]."),
    regex: Optional[str] = typer.Option(None, "--regex", metavar="REGEX", help="Constrain answers to match this regex [default: none]."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", metavar="FILE", help="Constrain answers to this Lark grammar (a file) [default: none]."),
    max_batch: str = typer.Option("auto", metavar="N", callback=_max_batch_values, help="Sequences decoded together, or auto: as many as the KV budget holds, at most 256."),
    kv_memory: str = typer.Option("auto", metavar="SIZE", help="KV cache budget, e.g. 2GiB, or auto: on a GPU 85% of the memory the weights leave free (reserved at once), on the CPU 4GiB (used as chunks fill)."),
    chunk_size: int = typer.Option(64, metavar="N", help="Tokens per KV chunk (a multiple of 16)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: skip rows already answered in --out."),
    rerun_changed: bool = typer.Option(False, "--rerun-changed", help="With --resume: answer again the rows whose request changed since they were answered."),
    ordered: bool = typer.Option(False, "--ordered", help="Write results in input order (buffers finished ones)."),
    order: str = typer.Option("prefix", "--order", metavar="ORDER", help="prefix: answer rows sharing a prompt prefix together, so each shared prefix is prefilled once while cached (the file is read twice; standard input is spooled to a temporary file); input: answer rows in file order."),
    fmt: str = typer.Option("auto", "--format", metavar="FORMAT", help="auto, template or openai."),
    id_field: str = typer.Option("id", metavar="FIELD", help="Field of each row that holds its id."),
    no_share: bool = typer.Option(False, "--no-share", help="Disable prefix sharing (for comparisons)."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Send each prompt's messages as plain text joined by blank lines instead of through the model's chat template (a base model, or one without a template: refused otherwise)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="On the GPU, run every decode step eagerly instead of replaying one CUDA graph per batch size (the CPU always runs eagerly)."),
    shard: Optional[str] = typer.Option(None, metavar="I/N", help="i/N: run only shard i of N (planned over the whole file: prompt-prefix groups kept whole where the balance allows)."),
    use_ray: bool = typer.Option(False, "--ray", help="Run on a Ray cluster: engine actors that live for the whole job (needs: pip install 'chunkgen[ray]')."),
    workers: Optional[int] = typer.Option(None, min=1, metavar="N", help="With --ray: engine actors [default: one per GPU with --device cuda, else 2]."),
    ray_address: Optional[str] = typer.Option(None, metavar="ADDRESS", help="With --ray: cluster address [default: start a local one]."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress; the summary only."),
    json_log: bool = typer.Option(False, "--json-log", help="Progress and summary as JSON lines on stderr."),
) -> None:
    """Generate an answer for every query and stream them to --out.

    Sampling options and constraints (--max-new-tokens to --grammar) can be set in four places; for
    each one separately, a row's own value wins, then the command line's, then the template's, then
    the default shown here. A constraint counts as one setting whatever its kind: a row's regex
    replaces a template's JSON schema."""
    from chunkgen.jobs.lock import OutputLocked
    from chunkgen.jobs.order import QueryFileChanged, TempSpaceError
    from chunkgen.jobs.results import OutputError, OutputExists, ResultWriter
    from chunkgen.model import display_name

    # Everything a user can get wrong is checked here, before the model loads.
    _check_format(fmt)
    _check_order(order)
    if max_new_tokens is not None and max_new_tokens < 1:
        _usage("--max-new-tokens", f"must be at least 1, not {max_new_tokens}")
    if rerun_changed and not resume:
        _usage("--rerun-changed", "goes with --resume")
    _check_queries(queries)
    _check_out(out, queries)
    chosen_device = _check_device(device).device
    budget = _check_engine_options(dtype, chosen_device, chunk_size, kv_memory)
    defaults = {k: v for k, v in dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, seed=seed, stop=stop or None, logprobs=logprobs,
                                      presence_penalty=presence_penalty,
                                      frequency_penalty=frequency_penalty).items() if v is not None}
    defaults.update(_constraint_options(json_schema, regex, grammar))
    _check_defaults(defaults)
    part = None
    if shard is not None:
        from chunkgen.scale.shard import Shard

        try:
            part = Shard.parse(shard)
        except ValueError as exc:
            _usage("--shard", str(exc))
    if use_ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            _fail("--ray needs Ray: pip install 'chunkgen[ray]'")
    if part is not None and queries == "-":
        _usage("--shard", "plans over the whole file before it runs: give --queries a file, not standard input")
    queries = _csv_as_jsonl(queries)
    _check_not_empty(queries)
    _check_tmpdir(queries, order == "prefix" and not use_ray)
    plan = None
    if part is not None:
        from chunkgen.scale.shard import plan_items

        fmt, planned, _, _ = _read_items(queries, template, fmt, defaults, id_field)
        plan = plan_items(planned, part.count)
        if not plan.rows(part.index):
            return _write_empty_shard(out, queries, part, plan.loads, resume, json_log)
    # Ray groups rows by prefix on the cluster; the prefix order is a local run's.
    fmt, items, templates, prefix_order = _read_items(queries, template, fmt, defaults, id_field,
                                                      prefix_order=order == "prefix" and not use_ray)
    if plan is not None:
        items = plan.select(items, part.index)
    model_dir = _resolve(model)
    if budget is not None:
        _check_budget(model_dir, chunk_size, dtype, chosen_device, budget)
    _check_tokenizer(templates, model_dir, chat_template=not no_chat_template)
    # A local run resolves auto again in the LLM (the same answer) so its summary says why; Ray
    # workers get the device chosen here.
    llm_kwargs = dict(model=str(model_dir), dtype=dtype, chunk_size=chunk_size, kv_memory=kv_memory,
                      max_batch=max_batch, share_prefix=not no_share, device=chosen_device if use_ray else device,
                      enforce_eager=True if enforce_eager else None, chat_template=not no_chat_template)
    stop_flag = _StopFlag(out)  # from here on, a signal is never a traceback: the writer may be repairing
    writer = None
    try:
        try:
            writer = ResultWriter(out, fmt, model_name=display_name(model_dir), resume=resume, ordered=ordered,
                                  rerun_changed=rerun_changed)
        except (OutputLocked, OutputExists, OutputError) as exc:
            _fail(str(exc))
        except OSError as exc:
            _fail(f"cannot write {out}: {exc.strerror or exc}")
        for note in writer.notes:
            err.print(f"note: {note}", highlight=False)
        if use_ray:
            summary = _run_ray(items, writer, llm_kwargs, workers, ray_address, chosen_device, stop_flag)
        else:
            summary = _run_local(items, writer, llm_kwargs, _count_lines(queries), stop_flag, quiet, json_log,
                                 prefix_order)
    except OutputError as exc:
        _fail(str(exc))
    except (QueryFileChanged, TempSpaceError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:  # a second signal: stop at once, without the end-of-run rewrite
        stop_flag.settle()
        if writer is not None:
            writer.close(rewrite=False)
        err.print(f"stopped at once by a second signal: every record written to {out} is whole; run the "
                  "same command with --resume to continue", highlight=False)
        raise typer.Exit(EXIT_SIGNAL[stop_flag.signum or signal.SIGINT])
    finally:
        if writer is not None:
            writer.close()  # after an error: releases the lock (a no-op when the run closed it)
        stop_flag.restore()
        if prefix_order is not None:
            prefix_order.rows.close()
    if queries == "-" and part is None and not summary.interrupted and \
            summary.requests + summary.skipped + summary.errors == 0:  # a file was checked before the model loaded
        _fail("standard input held no rows; nothing was run")
    # A signal that came after every row had its record (during the final rewrite) stopped nothing.
    _report(summary, out, quiet, json_log, stop_flag.signum if summary.interrupted else None)


def _write_empty_shard(out: Path, queries: str, part, loads: list[int], resume: bool, json_log: bool) -> None:
    """A shard the plan gave no rows: its (empty) output file, so a collect step finds every shard's."""
    from chunkgen.jobs.lock import OutputLock, OutputLocked
    from chunkgen.jobs.run import JobSummary

    try:
        with OutputLock(out):
            if out.exists() and out.stat().st_size and not resume:
                _fail(f"{out} already has results; pass --resume to continue it, or choose another --out")
            out.touch()
    except OutputLocked as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror or exc}")
    err.print(f"shard {part.index}/{part.count}: none of the {sum(loads)} rows of {queries} fall to this shard "
              f"(rows per shard: {', '.join(map(str, loads))}); wrote an empty {out}", highlight=False)
    if json_log:
        summary = JobSummary(requests=0, skipped=0, errors=0, changed=0, prompt_tokens=0, cached_tokens=0,
                             completion_tokens=0, wall_s=0.0, prefill_s=0.0, decode_s=0.0, kv_peak_bytes=0,
                             kv_unshared_peak_bytes=0, workers=0, model_loads=0)
        print(json.dumps({"event": "summary", **summary.as_dict()}), file=sys.stderr, flush=True)


def _run_local(items, writer, llm_kwargs: dict, total: int | None, stop_flag: _StopFlag, quiet: bool, json_log: bool,
               prefix_order=None):
    from chunkgen.jobs.run import run_job

    llm = _load_llm(announce="none" if quiet else "json" if json_log else "line", **llm_kwargs)
    from chunkgen.model.precision import DTYPE_NAMES

    precision = f"{DTYPE_NAMES.get(llm.model.dtype, str(llm.model.dtype))} ({llm.dtype_reason})"
    if prefix_order is not None and not (quiet or json_log):
        err.print("--order prefix: every row is read and keyed by its prompt's text before the first is answered, so rows "
                  "sharing a prefix run together (--order input skips this pass)", highlight=False)
    on_progress, stop_progress = _progress_printer(quiet, json_log, total)
    try:
        summary = run_job(llm.engine, llm.encode, items, writer, total=total, should_stop=stop_flag,
                          on_progress=on_progress, order=prefix_order)
        summary.dtype = precision
        summary.device = f"{llm.device} ({llm.device_choice.reason})"
        summary.kv_memory = _kv_text(llm)
        summary.max_batch = f"{llm.batch_choice.rows} ({llm.batch_choice.reason})"
        return summary
    finally:
        stop_progress()


def _report(summary, out: Path, quiet: bool, json_log: bool, signum: int | None) -> None:
    if json_log:
        print(json.dumps({"event": "summary", **summary.as_dict()}), file=sys.stderr, flush=True)
    elif summary.requests == 0 and summary.errors == 0 and summary.skipped and not signum:
        err.print(f"every query was already answered in {out} ({summary.skipped} rows); nothing to do",
                  highlight=False)
    else:
        table = Table(title=f"chunkgen run → {out}", show_header=False)
        table.add_row("requests answered", str(summary.requests))
        table.add_row("skipped (already in output)", str(summary.skipped))
        table.add_row("error records", str(summary.errors))
        table.add_row("wall time", f"{summary.wall_s:.1f} s (prefill {summary.prefill_s:.1f} s, decode {summary.decode_s:.1f} s)")
        table.add_row("generated tokens", f"{summary.completion_tokens} ({summary.tokens_per_s:.1f} tok/s)")
        table.add_row("prompt tokens", f"{summary.prompt_tokens}: {summary.cached_tokens} from the cache "
                      f"(hit rate {100 * summary.cache_hit_rate:.1f}%)"
                      + (f", {summary.prefilled_tokens} computed" if summary.prefilled_tokens else ""))
        if summary.order == "prefix":
            table.add_row("order", f"prefix (every row keyed first: {summary.order_s:.1f} s)")
        if summary.workers > 1 or summary.model_loads != 1:
            table.add_row("workers (model loads)", f"{summary.workers} ({summary.model_loads})")
            table.add_row("peak KV memory per worker", ", ".join(map(_human, summary.kv_peak_bytes_per_worker)))
        if summary.constrained:
            table.add_row("answers matching their constraint",
                          f"{summary.matched} of {summary.constrained}"
                          + (" (the others were cut short by max_new_tokens or a stop string)" if summary.matched < summary.constrained else ""))
        if summary.dtype:
            table.add_row("dtype", summary.dtype)
        if summary.device:
            table.add_row("device", summary.device)
        if summary.kv_memory:
            table.add_row("KV budget", summary.kv_memory)
        if summary.peak_batch:
            table.add_row("batch", f"peak {summary.peak_batch} sequences"
                          + (f", at most {summary.max_batch}" if summary.max_batch else "")
                          + (f"; rows waited for KV memory in {summary.held_back_steps} steps"
                             if summary.held_back_steps else ""))
        table.add_row("peak KV memory", f"{_human(summary.kv_peak_bytes)} (the same sequences without sharing: "
                                        f"{_human(summary.kv_unshared_peak_bytes)})")
        err.print(table)
    if summary.changed:
        err.print(f"[yellow]warning:[/] {summary.changed} answer(s) in {out} were made for a request that has "
                  "changed since (its text, sampling or template); they were kept. Pass --rerun-changed "
                  "with --resume to answer them again.", highlight=False)
    if signum is not None:
        name = signal.Signals(signum).name
        err.print(f"stopped by {name}: {summary.requests + summary.errors} records written to {out} in this run; "
                  "run the same command with --resume to continue", highlight=False)
        raise typer.Exit(EXIT_SIGNAL[signum])
    if summary.errors:
        err.print(f"[yellow]{summary.errors} row(s) could not be answered; their error records are in {out}[/]",
                  highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT_LINES)


def _run_ray(items, writer, llm_kwargs: dict, workers: Optional[int], address: Optional[str], device: str,
             stop_flag: _StopFlag):
    from chunkgen.scale.ray import run_on_ray

    def started(shape) -> None:
        err.print(f"ray: {shape.count} workers, each with {shape.num_cpus:g} CPU(s)"
                  + (f" and {shape.num_gpus} GPU" if shape.num_gpus else ""), highlight=False)

    t0 = time.perf_counter()
    try:
        summary = run_on_ray(items, writer, llm_kwargs, workers, address=address, device=device,
                             should_stop=stop_flag, on_start=started)
    except (ValueError, RuntimeError) as exc:
        _fail(str(exc))
    err.print(f"ray: {summary.requests} answered, {summary.skipped} already done, {summary.errors} error record(s); "
              f"{time.perf_counter() - t0:.1f} s with {summary.workers} workers, {summary.model_loads} model loads",
              highlight=False)
    return summary


@app.command("inspect-tree")
def inspect_tree(
    queries: str = typer.Option(..., "--queries", "-q", metavar="FILE", help="JSONL queries or an OpenAI batch file; - reads standard input."),
    template: Optional[Path] = typer.Option(None, "--template", "-t", metavar="PATH", help="A .toml template or a directory of them."),
    model: Optional[str] = typer.Option(None, metavar="MODEL", help="Model whose tokenizer and KV shape are used [default: the embedded one]."),
    chunk_size: int = typer.Option(64, metavar="N", help="Tokens per KV chunk (a multiple of 16)."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="KV dtype the figures assume: fp32, bf16, fp16 or auto (as for run: the dtype a run here would use)."),
    fmt: str = typer.Option("auto", "--format", metavar="FORMAT", help="auto, template or openai."),
    id_field: str = typer.Option("id", metavar="FIELD", help="Field of each row that holds its id."),
    json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Write the figures as JSON here."),
    kv_memory: str = typer.Option("4GiB", metavar="SIZE", help="KV cache budget of the run to foresee: the cache hit rate it reaches in each --order."),
    max_batch: str = typer.Option("auto", metavar="N", callback=_max_batch_values, help="Sequences decoded together in the run to foresee (a number, or auto as for run)."),
) -> None:
    """Insert every prompt into a prefix tree (no model run) and show sharing, memory, and the cache
    hit rate a run with --kv-memory reaches in file order and in prefix order."""
    from transformers import AutoTokenizer

    from chunkgen.cache.stats import CacheReplay, plan_tree, tree_stats
    from chunkgen.jobs.requests import ErrorRecord
    from chunkgen.llm import encode_prompt
    from chunkgen.model.precision import DTYPE_NAMES

    _check_format(fmt)
    _check_chunk_size(chunk_size)
    kv_dtype = _dtype_option(dtype)
    _check_queries(queries)
    budget = _check_engine_options(dtype, "cpu", chunk_size, kv_memory)
    max_batch = _max_batch_option(max_batch)
    queries = _csv_as_jsonl(queries)
    _, items, _, prefix_order = _read_items(queries, template, fmt, {}, id_field, prefix_order=True)
    path = _resolve(model)
    _check_budget(path, chunk_size, dtype, "cpu", budget)
    tok = AutoTokenizer.from_pretrained(path)
    bad = 0
    names: list[str] = []  # per prompt, in prefix order: its template (or, for OpenAI rows, none)
    tokens_of: dict[int, list[int]] = {}  # row index -> its prompt's tokens
    template_of: dict[int, str] = {}
    prefix_prompts: list[list[int]] = []  # the prompts in prefix order, a run's default
    in_file_order = CacheReplay(_planning_pool(path, chunk_size, kv_dtype, budget), max_batch)
    in_prefix_order = CacheReplay(_planning_pool(path, chunk_size, kv_dtype, budget), max_batch)

    def in_file_order_rows():
        nonlocal bad
        for index, item in enumerate(items):
            if isinstance(item, ErrorRecord):
                bad += 1
                continue
            tokens = tokens_of[index] = encode_prompt(tok, item.messages, item.data)
            template_of[index] = item.template or "OpenAI rows"
            in_file_order.add(tokens)
            yield index, item

    try:
        for index, _ in prefix_order.apply(in_file_order_rows(), chunk_size):
            prefix_prompts.append(tokens_of.pop(index))
            names.append(template_of.pop(index))
            in_prefix_order.add(prefix_prompts[-1])
    finally:
        prefix_order.rows.close()

    from chunkgen.engine.engine import EngineConfig

    tree = plan_tree(_planning_pool(path, chunk_size, kv_dtype), prefix_prompts, EngineConfig.max_prefill_tokens)
    st = tree_stats(tree)
    replays = {"input": in_file_order, "prefix": in_prefix_order}
    figures = {"sequences": st.sequences, "tokens": st.tokens, "chunks_shared": st.chunks_shared,
               "chunks_unshared": st.chunks_unshared, "bytes_shared": st.bytes_shared,
               "bytes_unshared": st.bytes_unshared, "sharing_ratio": st.sharing_ratio,
               "prefill_tokens_saved": st.cache_hit_tokens, "bad_lines": bad, "kv_memory": budget,
               "max_batch": max_batch,
               **{f"{name}_order": {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                                    "prefilled_tokens": r.prompt_tokens - r.cached_tokens,
                                    "cache_hit_rate": r.hit_rate} for name, r in replays.items()}}
    view = Tree(f"[bold]prefix forest[/] ({st.sequences} prompts, chunk {chunk_size} tokens)")
    templates_under: dict[int, set[str]] = {}  # chunk -> templates of the prompts that read it
    for seq, path_ in tree.paths.items():
        for chunk in path_:
            templates_under.setdefault(id(chunk), set()).add(names[seq])
    _draw(tree.root, view, templates_under)
    console = stdout
    console.print(view)
    table = Table(title=f"KV memory to hold all {st.sequences} prompts at once ({DTYPE_NAMES.get(kv_dtype, dtype)})", show_header=True)
    table.add_column("")
    table.add_column("chunks", justify="right")
    table.add_column("bytes", justify="right")
    table.add_row("with sharing", str(st.chunks_shared), _human(st.bytes_shared))
    table.add_row("without sharing (each prompt its own chunks)", str(st.chunks_unshared), _human(st.bytes_unshared))
    console.print(table)
    console.print(
        f"sharing ratio {100 * st.sharing_ratio:.1f}%: the share of chunks that sharing saves\n"
        f"prefill tokens saved {st.cache_hit_tokens} of {st.inserted_tokens}: prompt tokens already in the tree "
        "when each prompt is inserted, in file order and in prefill waves as a run forms them (the run's "
        "'from cache' count; a run with more prompts than --max-batch may differ by a few tokens), while its "
        "peak KV memory counts only the sequences running at once, with their answers\n"
        f"alignment loss {100 * st.alignment_loss:.1f}%: token slots left empty in partly filled chunks (the "
        f"last chunk of each prompt, and a shared prefix that ends inside a chunk), per token stored; "
        "a smaller --chunk-size lowers it", highlight=False)
    hits = Table(title=f"cache hit rate of a run with --kv-memory {_human(budget)}, --max-batch {max_batch}")
    for col in ("--order", "prompt tokens", "from the cache", "computed", "hit rate"):
        hits.add_column(col, justify="right")
    for name, r in replays.items():
        hits.add_row(name, str(r.prompt_tokens), str(r.cached_tokens), str(r.prompt_tokens - r.cached_tokens),
                     f"{100 * r.hit_rate:.1f}%")
    console.print(hits)
    if in_file_order.too_long:
        console.print(f"{in_file_order.too_long} prompt(s) do not fit in --kv-memory {_human(budget)} at all: "
                      "a run refuses them")
    if json_out:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")


def _draw(node, view: Tree, templates_under: dict[int, set[str]], top: bool = True) -> None:
    """Shared runs are collapsed into one line; a fan-out of private tails is summarised. The
    outermost branches name the templates whose prompts they hold."""
    for child in node.children:
        run, cur = 1, child
        while len(cur.children) == 1 and cur.children[0].ref == cur.ref:
            cur, run = cur.children[0], run + 1
        if cur.ref <= 1 and not cur.children:
            continue
        label = f"{run} chunk(s) shared by {cur.ref} prompts"
        if top:
            names = sorted(templates_under.get(id(child), ()))
            label += f" · {'template' if len(names) == 1 else 'templates'} {', '.join(names)}"
        branch = view.add(escape(label))
        private = sum(1 for c in cur.children if c.ref <= 1)
        if private:
            branch.add(f"[dim]{private} private tail(s)[/]")
        _draw(cur, branch, templates_under, top=False)


@bench_app.command("kernel")
def bench_kernel(
    quick: bool = typer.Option(False, help="A small subset that runs in seconds."),
    dtype: Optional[str] = typer.Option(None, metavar="DTYPE", help="KV dtype: fp32 or bf16 on the CPU (default fp32); "
                                                   "fp16, bf16 or fp32 on CUDA (default fp16)."),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda or cuda:N (as for run)."),
    json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Also write the rows as JSON here."),
    repeats: int = typer.Option(10, metavar="N", help="Timed runs per cell (median reported)."),
    impls: str = typer.Option("naive,sdpa,paged,paged_shared,chunk_tpp", metavar="NAME[,NAME...]", help="Implementations to time."),
) -> None:
    """Decode attention latency, paper Table 3 style: naive, sdpa, paged, paged_shared, chunk_tpp."""
    import torch

    from chunkgen.bench.kernel import IMPLS, default_grid, run_grid
    from chunkgen.device import device_guard
    from chunkgen.model import parse_dtype

    chosen = tuple(i.strip() for i in impls.split(",") if i.strip())
    if not chosen or set(chosen) - set(IMPLS):
        _fail(f"--impls takes a subset of {','.join(IMPLS)}")
    choice = _check_device(device)
    device = choice.device
    err.print(f"device {device} ({choice.reason})", highlight=False)
    on_cuda = device.startswith("cuda")
    kv_dtype = parse_dtype(dtype or ("fp16" if on_cuda else "fp32"))
    if not on_cuda and kv_dtype == torch.float16:
        _fail("the CPU kernel takes fp32 or bf16 K/V; fp16 is for --device cuda")
    with device_guard(device):
            rows = run_grid(default_grid(quick), kv_dtype, repeats=3 if quick else repeats, impls=chosen, device=device,
                        on_row=lambda r: err.print(f"  {r['impl']:>13} n_p={r['n_p']} n_s={r['n_s']} "
                                                   f"H={r['q_heads']}/{r['kv_heads']}: {r['us']:.0f} us", highlight=False))
    _print_kernel_table(rows)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


@bench_app.command("e2e")
def bench_e2e(
    model: Optional[str] = typer.Option(None, metavar="MODEL", help="As for run [default: the embedded SmolLM2-135M-Instruct]."),
    n_shared: str = typer.Option("1024,2048", metavar="N[,N...]", help="Shared prompt lengths in tokens, comma-separated."),
    n_queries: int = typer.Option(32, metavar="N", help="Queries per run, each the shared prompt plus its own question."),
    max_new_tokens: int = typer.Option(64, metavar="N", help="Tokens generated per query (greedy)."),
    max_batch: str = typer.Option("auto", metavar="N[,N...]", callback=_max_batch_values, help="Sequences decoded together by chunkgen's engines: a number or auto (as for run); several, comma-separated, give a row each."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="fp32, bf16, fp16 (GPU) or auto (as for run)."),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda or cuda:N (as for run); transformers' hf system runs there too."),
    kv_memory: str = typer.Option("8GiB", metavar="SIZE", help="KV budget of chunkgen's engines, e.g. 8GiB, or auto (as for run; on a GPU it leaves no room for the hf system)."),
    dummy_weights: Optional[str] = typer.Option(None, "--dummy-weights", metavar="CONFIG", help="Instead of --model: random weights (seeded) of the shapes in CONFIG, a shipped name (smollm2-135m, llama-3.2-1b, llama-2-7b, qwen3-0.6b, qwen3-4b, gemma-3-1b, phi-3-mini) or a Hugging Face config.json. Prompts are token ids; outputs are not meaningful, speed and memory are."),
    seed: int = typer.Option(0, metavar="N", help="With --dummy-weights: the seed the weights are drawn from."),
    systems: str = typer.Option(",".join(("hf", "chunkgen_noshare", "chunkgen_paged", "chunkgen")), metavar="NAME[,NAME...]",
                                help="Subset of hf, chunkgen_noshare, chunkgen_paged, chunkgen, chunkgen_schema "
                                     "(chunkgen with every answer held to a JSON schema of tool calls: the cost of masking)."),
    quick: bool = typer.Option(False, help="512 shared tokens, 8 queries, 16 new tokens."),
    repeat: int = typer.Option(1, min=1, metavar="N", help="Rounds in which the systems take turns; each row is the median round."),
    json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Also write the rows as JSON here."),
) -> None:
    """Whole runs side by side: transformers generate vs chunkgen without sharing, paged, full, constrained."""
    from chunkgen.bench.e2e import SYSTEMS, run_e2e

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = set(chosen) - set(SYSTEMS)
    if unknown:
        _fail(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    chosen = [s for s in SYSTEMS if s in chosen]  # hf first: the others are compared with it
    if quick:
        n_shared, n_queries, max_new_tokens = "512", 8, 16
    lengths = [int(x) for x in n_shared.split(",")]
    chosen_device = _check_device(device).device
    if model is not None and dummy_weights is not None:
        _usage("--dummy-weights", "replaces --model; give one of them")
    _check_engine_options(dtype, chosen_device, 64, kv_memory)
    batches = {b.strip(): _max_batch_option(b) for b in max_batch.split(",")}  # label: rows
    _check_dummy_fits(dummy_weights, dtype, chosen_device, copies=2 if "hf" in chosen else 1)
    llm = _load_llm(model, dtype=dtype, device=device, max_batch=max(batches.values()), kv_memory=kv_memory,
                    dummy_weights=dummy_weights, seed=seed)
    dtype = _dtype_line(llm)
    current: dict[str, Any] = {}  # the run in progress, for the ticker's lines

    def on_start(system: str, ns: int, round_: int) -> None:
        now = time.perf_counter()
        current.update(name=f"{system:>16} n_shared={ns} round {round_}", since=now, printed=now)
        err.print(f"  {current['name']}: running…", highlight=False)

    def tick() -> None:
        now = time.perf_counter()
        if current and now - current["printed"] >= PROGRESS_EVERY_S:
            current["printed"] = now
            err.print(f"  {current['name']}: still running, {now - current['since']:.0f} s", highlight=False)

    def on_row(r: dict) -> None:
        current.clear()
        err.print(f"  {r['system']:>16} n_shared={r['n_shared']}"
                  + (f" batch {r['max_batch']}" if len(batches) > 1 and r.get("max_batch") else "")
                  + f" round {r['round']}: "
                  f"{r['gen_tokens_per_s']:.1f} tok/s, wall {r['wall_s']:.1f} s"
                  + (f" (+{r['constraint_setup_s']:.1f} s grammar set-up, once, not in the wall time)"
                     if r.get("constraint_setup_s") else ""), highlight=False)

    ticker = _Ticker(tick, min(1.0, PROGRESS_EVERY_S / 4))
    try:
        rows = run_e2e(llm, lengths, n_queries, max_new_tokens, chosen, dtype, repeat=repeat,
                       on_row=on_row, on_start=on_start, batches=batches)
    finally:
        ticker.stop()
    table = Table(title=f"end to end: {n_queries} queries, {max_new_tokens} new tokens, {dtype}"
                  + (f", median of {repeat} rounds" if repeat > 1 else ""))
    # With rounds, the first one apart: a fresh process's first run is what every `chunkgen run` is.
    first = ("round 1 gen tok/s",) if repeat > 1 else ()
    for col in ("system", "n_shared", "batch", "wall s", "prefill s", "decode s", "mask s", "gen tok/s", *first,
                "decode tok/s", "KV peak", "RSS peak", "= hf"):
        table.add_column(col, justify="right")
    for r in rows:
        batch = "-" if r.get("max_batch") is None else f"{r['max_batch']} (peak {r['peak_batch']})"
        table.add_row(r["system"], str(r["n_shared"]), batch, f"{r['wall_s']:.1f}", f"{r['prefill_s']:.1f}",
                      f"{r['decode_s']:.1f}", f"{r['mask_s']:.2f}" if "mask_s" in r else "-",
                      f"{r['gen_tokens_per_s']:.1f}",
                      *([f"{r['gen_tokens_per_s_runs'][0]:.1f}"] if first else []), f"{r['decode_tokens_per_s']:.1f}",
                      _human(r["kv_peak_bytes"]), _human(r["rss_peak_bytes"]),
                      "-" if r["outputs_equal_to_hf"] is None else f"{r['outputs_equal_to_hf']}/{r['n_queries']}")
    stdout.print(table)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


def _check_dummy_fits(spec: Optional[str], dtype: str, device: str, copies: int) -> None:
    """Before anything is built: the config can be read and `copies` models of it fit in memory."""
    if spec is None:
        return
    from chunkgen.device import free_bytes
    from chunkgen.model import dummy

    try:
        config = dummy.load_config(spec)
        chosen = _dtype_option(dtype, device) or dummy.config_dtype(config)
        dummy.check_fits(config, chosen, device, free_bytes(device), copies)
    except dummy.DummyWeightsError as exc:
        _fail(str(exc) + ("; leave hf out of --systems to build one copy" if copies > 1 and "more than" in str(exc) else ""))


@bench_app.command("order")
def bench_order(
    model: Optional[str] = typer.Option(None, metavar="MODEL", help="Model to run [default: the embedded one]."),
    docs: int = typer.Option(100, min=1, metavar="D", help="Documents (distinct shared prefixes)."),
    questions: int = typer.Option(4, min=1, metavar="Q", help="Questions on each document (rows sharing its prefix)."),
    doc_tokens: str = typer.Option("300", metavar="T|LO-HI", help="Tokens per document: T, or LO-HI drawn uniformly."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle", help="Rows in random order, as merged files are; else document by document."),
    seed: int = typer.Option(0, metavar="N", help="Seed of the documents, questions and shuffle."),
    kv_memory: str = typer.Option("auto", metavar="SIZE", help="KV cache budget [default auto: a tenth of the distinct prompt tokens, at least two of the longest prompts]."),
    max_batch: int = typer.Option(16, min=1, metavar="N", help="Sequences decoded together."),
    max_new_tokens: int = typer.Option(16, min=1, metavar="N", help="Tokens generated per answer."),
    dtype: str = typer.Option("fp32", metavar="DTYPE", help="fp32, bf16 or fp16."),
    orders: str = typer.Option("input,prefix", metavar="ORDERS", help="Orders to run, in turn: input, prefix."),
    write_workload: Optional[Path] = typer.Option(None, metavar="DIR", help="Also keep the template and queries here (for chunkgen run)."),
    dump_token_ids: Optional[Path] = typer.Option(None, metavar="FILE", help="Write the prompts' token ids (file order) for the vLLM comparison script, and run nothing."),
    json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Write the rows as JSON here."),
) -> None:
    """Retrieval QA, shuffled: prefix order against file order on the same file and KV budget."""
    from chunkgen.bench.order import docqa_rows, dump_token_ids as dump, parse_doc_tokens, run_order_bench
    from chunkgen.llm import parse_bytes

    chosen = [o.strip() for o in orders.split(",") if o.strip()]
    for o in chosen:
        _check_order(o)
    try:
        lengths = parse_doc_tokens(doc_tokens)
    except ValueError as exc:
        _usage("--doc-tokens", str(exc))
    llm = _load_llm(model, dtype=dtype, max_batch=max_batch, kv_memory="64MiB")
    rows = docqa_rows(llm.tokenizer, docs, questions, lengths, shuffle, seed)
    if dump_token_ids:
        dump(llm, rows, max_new_tokens, dump_token_ids)
        err.print(f"{len(rows)} prompts written to {dump_token_ids}", highlight=False)
        return
    try:
        budget = None if kv_memory == "auto" else parse_bytes(kv_memory)
    except ValueError as exc:
        _usage("--kv-memory", str(exc))
    report = run_order_bench(llm, rows, chosen, budget, max_batch, max_new_tokens, write_workload,
                             on_row=lambda r: err.print(f"  {r['order']:>6}: {r['prefilled_tokens']} tokens prefilled, "
                                                        f"wall {r['wall_s']:.1f} s, {r['gen_tokens_per_s']:.1f} tok/s",
                                                        highlight=False))
    budget = report["kv_memory"]
    table = Table(title=f"docqa: {len(rows)} rows, {docs} documents of {doc_tokens} tokens, {questions} questions each, "
                        f"{'shuffled' if shuffle else 'in document order'}; KV {_human(budget)}, batch {max_batch}, "
                        f"{max_new_tokens} new tokens, {dtype}; minimum prefill {report['minimum_prefill_tokens']} of "
                        f"{report['prompt_tokens']} prompt tokens")
    for col in ("order", "prefilled tokens", "x minimum", "hit rate", "wall s", "ordering s", "prefill s",
                "decode s", "gen tok/s", "RSS peak", "answers = first"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(r["order"], str(r["prefilled_tokens"]), f"{r['prefill_vs_minimum']:.2f}",
                      f"{100 * r['cache_hit_rate']:.1f}%", f"{r['wall_s']:.1f}", f"{r['order_s']:.2f}",
                      f"{r['prefill_s']:.1f}", f"{r['decode_s']:.1f}", f"{r['gen_tokens_per_s']:.1f}",
                      _human(r["rss_peak_bytes"]), f"{r['answers_equal_to_first']}/{r['rows']}")
    stdout.print(table)
    if json_out:
        json_out.write_text(json.dumps({"docs": docs, "questions": questions, "doc_tokens": doc_tokens,
                                        "shuffle": shuffle, "max_batch": max_batch,
                                        "max_new_tokens": max_new_tokens, "dtype": dtype, **report}, indent=2) + "\n")


@bench_app.command("order-pass")
def bench_order_pass(
    rows: int = typer.Option(1_000_000, min=1, metavar="N", help="Short rows in the file."),
    prefixes: int = typer.Option(1000, min=1, metavar="N", help="Distinct personas (shared prefixes), interleaved at random."),
    work_dir: Optional[Path] = typer.Option(None, metavar="DIR", help="Where the file is written [default: a temporary folder]."),
    run_rows: int = typer.Option(1 << 18, min=1, metavar="N", help="Keys held in memory before a sorted run is spilled to disk."),
) -> None:
    """The cost of --order prefix alone on a large file: keying, sorting and re-reading every row
    (no model: the peak RSS is the pass's own)."""
    import tempfile

    from chunkgen.bench.order import ordering_pass, write_persona_rows

    with tempfile.TemporaryDirectory(prefix="chunkgen-order-pass-") as tmp:
        template, queries = write_persona_rows(work_dir or Path(tmp), rows, prefixes)
        r = ordering_pass(template, queries, run_rows=run_rows)
    stdout.print(f"{r['rows']} rows over {prefixes} prefixes: ordering pass {r['wall_s']:.1f} s "
                 f"(keying {r['keying_s']:.1f} s, re-reading {r['reread_s']:.1f} s; {r['rows'] / r['wall_s']:.0f} rows/s), "
                 f"{r['spilled_runs']} sorted runs spilled, rows come out in {r['prefix_runs']} runs of one prefix, "
                 f"peak RSS {_human(r['rss_peak_bytes'])}")


@bench_app.command("step")
def bench_step(
    model: Optional[str] = typer.Option(None, metavar="MODEL", help="As for run [default: the embedded SmolLM2-135M-Instruct]."),
    n_shared: int = typer.Option(2048, metavar="N", help="Shared prompt length in tokens."),
    n_queries: int = typer.Option(32, metavar="N", help="Sequences in the decode batch."),
    steps: int = typer.Option(30, metavar="N", help="Decode steps timed (their mean is printed)."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="fp32, bf16 or auto (as for run)."),
    json_out: Optional[Path] = typer.Option(
        None, "--json", metavar="FILE", help="Also measure the host's share of a step and write every figure to this file: "
        "ops_per_step (profiler, this model and batch), host_floor_ms_b32 / _b256 (CPU time of a step of a "
        "30-layer random model with hidden size 64, the attention op dispatched without its arithmetic; "
        "cpu_step_ms_b32 / _b256 with it), graph_breaks (torch._dynamo.explain of the decode forward)."),
) -> None:
    """Split of one decode step: attention, linear layers, other model ops, engine (tree, sampling)."""
    from chunkgen.bench import step as bench
    from chunkgen.bench.e2e import build_workload

    llm = _load_llm(model, dtype=dtype, max_batch=n_queries, kv_memory="8GiB")
    dtype = _dtype_line(llm)
    prompts = build_workload(llm, n_shared, n_queries, steps).prompts
    r = bench.profile_decode_steps(llm, prompts, steps)
    stdout.print(f"decode step at batch {r['batch']} ({n_shared} shared tokens, {dtype}, mean of {r['steps']} steps): "
                 f"{r['step_ms']:.1f} ms = attention {r['attention_ms']:.1f} + linear layers {r['linear_ms']:.1f}"
                 f" + other model ops {r['other_model_ms']:.1f} + engine (tree, sampling, Python) {r['engine_ms']:.1f}")
    if json_out:
        floor = bench.host_floor_engine(llm.tokenizer)
        r.update(ops_per_step=bench.ops_per_step(llm, prompts), host_floor_ms_b32=bench.host_floor_ms(floor, 32),
                 host_floor_ms_b256=bench.host_floor_ms(floor, 256),
                 cpu_step_ms_b32=bench.host_floor_ms(floor, 32, attention=True),
                 cpu_step_ms_b256=bench.host_floor_ms(floor, 256, attention=True),
                 graph_breaks=bench.graph_breaks(llm, prompts))
        stdout.print(f"host share: {r['ops_per_step']} ops a step; host floor {r['host_floor_ms_b32']:.2f} ms at "
                     f"batch 32, {r['host_floor_ms_b256']:.2f} ms at batch 256 (with the CPU attention kernel: "
                     f"{r['cpu_step_ms_b32']:.2f} and {r['cpu_step_ms_b256']:.2f} ms); {r['graph_breaks']} graph breaks")
        json_out.write_text(json.dumps(r, indent=2) + "\n")


@bench_app.command("machine")
def bench_machine() -> None:
    """The ceilings the kernel is compared with: fp32 FMA GFLOP/s and streaming-read GB/s."""
    from chunkgen.bench.machine import machine_ceilings

    r = machine_ceilings()
    stdout.print(f"fp32 FMA peak {r['fma_gflops']:.0f} GFLOP/s ({r['simd_lanes']} lanes, all threads); "
                 f"streaming read {r['read_gb_s']:.1f} GB/s (torch sum over {r['read_mib']} MiB)")


@bench_app.command("tree")
def bench_tree(sequences: int = typer.Option(64, metavar="N", help="Sequences decoding on one shared prefix."),
               json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE",
                                                       help="Also write the figures as JSON here.")) -> None:
    """Per-step cost of the prefix tree's bookkeeping (appends + kernel context), and of a rebuild."""
    from chunkgen.bench.tree import tree_overhead

    r = tree_overhead(sequences)
    stdout.print(f"{r['sequences']} sequences, {r['steps']} decode steps: tree work per step "
                    f"{r['step_us_median']:.0f} µs median ({r['step_us_p90']:.0f} µs p90), "
                    f"{r['rebuilds_during_steps']} rebuilds; full context rebuild {r['rebuild_us_median']:.0f} µs")
    if json_out:
        json_out.write_text(json.dumps(r, indent=2) + "\n")


def _print_kernel_table(rows: list[dict]) -> None:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title="decode attention latency (µs, median)")
    for col in ("shape", "n_p", "n_s", *impls, "tpp speedup vs best other"):
        table.add_column(col, justify="right")
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (f"b{r['batch']} h{r['q_heads']}/{r['kv_heads']} d{r['head_dim']} c{r['chunk']} {r['dtype']} {r['device']}"
               f" q/out {r.get('q_dtype', r['dtype'])}",
               r["n_p"], r["n_s"])
        cells.setdefault(key, {})[r["impl"]] = r["us"]
    for (shape, n_p, n_s), by in cells.items():
        others = [v for k, v in by.items() if k != "chunk_tpp"]
        speed = f"{min(others) / by['chunk_tpp']:.2f}x" if others and "chunk_tpp" in by else "-"
        table.add_row(shape, str(n_p), str(n_s), *[f"{by[i]:.0f}" if i in by else "-" for i in impls], speed)
    stdout.print(table)
    paths = sorted({r["cpu_path"] for r in rows if r.get("cpu_path")})
    if paths:
        stdout.print(f"CPU kernel path: {', '.join(paths)} (CHUNKGEN_CPU_ISA forces a lower one)")


def main() -> None:  # pragma: no cover
    app()
