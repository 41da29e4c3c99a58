"""The command line's frame: the typer app, its one exception boundary (every error one line,
never a traceback), exit codes and the two consoles. The commands live beside it (run.py,
inspect_tree.py, bench.py), each a thin layer over jobs/, the LLM and bench/."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from chunkgen.jobs.stop import EXIT_SIGNAL

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

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = signum


class _Terminated(KeyboardInterrupt):
    """SIGTERM before a run installs its own handling (checks, a model's conversion): an interrupt
    said in one line with its own exit code, not a silent death."""

    signum = signal.SIGTERM


def _terminated(signum, frame) -> None:
    raise _Terminated()


TTY = sys.stderr.isatty()
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
    """click's type and range messages (click 8.1 under older typer, typer 0.27's own copy), in the
    same words as _value_error_text gives newer typer's."""
    import re

    message = message.strip().removesuffix(".")
    m = re.fullmatch(r"'?(.*?)'? is not a valid (integer|int|float)( range)?", message)  # typer 0.27: "int"
    if m:
        return f"must be {'a number' if m[2] == 'float' else 'an integer'}, not {m[1]!r}"
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
        words = {
            "greater_than_equal": "at least",
            "less_than_equal": "at most",
            "greater_than": "more than",
            "less_than": "less than",
        }[kind]
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
        except KeyboardInterrupt as exc:
            raise _Interrupted(getattr(exc, "signum", signal.SIGINT)) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise _Interrupted(getattr(exc, "signum", signal.SIGINT)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra: Any):
        saved = {s: signal.getsignal(s) for s in EXIT_SIGNAL}
        if saved[signal.SIGTERM] in (signal.SIG_DFL, None) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _terminated)
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
            err.print(f"[bold red]error:[/] {escape(one_line(_usage_error_text(e)))}", highlight=False)
            sys.exit(e.exit_code)
        except (_Interrupted, KeyboardInterrupt) as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            err.print(f"interrupted ({signal.Signals(signum).name}); nothing was written after it", highlight=False)
            sys.exit(EXIT_SIGNAL[signum])
        except BaseException as e:
            if isinstance(e, SystemExit) or os.environ.get("CHUNKGEN_TRACEBACK"):
                raise
            if _ABORT and isinstance(e, _ABORT):
                err.print("aborted", highlight=False)
            elif not isinstance(e, Exception):
                raise
            else:
                err.print(f"[bold red]error:[/] {escape(unexpected_text(e))}", highlight=False)
            sys.exit(EXIT_ERROR)
        sys.exit(code if isinstance(code, int) else 0)


def unexpected_text(e: BaseException) -> str:
    """An error no check foresaw, in one line: a full disk or an unwritable temporary folder in
    the user's words, anything else by its type and message, with how to see where it came from."""
    import errno
    import tempfile

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
        if e.filename is None or str(e.filename).startswith(tempfile.gettempdir()):
            return (
                f"cannot write the temporary folder {tempfile.gettempdir()} (TMPDIR): {e.strerror}; free "
                "space there or set TMPDIR to a writable folder with room"
            )
        return f"cannot write {e.filename}: {e.strerror}"
    text = " ".join(str(e).split()) or "(no message)"
    if type(e).__name__ == "OutOfMemoryError":  # torch's, from the GPU: the user's to fix, not a defect
        return (
            f"the GPU ran out of memory ({'. '.join(text.split('. ')[:2])}): give a smaller --max-batch or --kv-memory "
            "(auto leaves room for the activations)"
        )
    return (
        f"unexpected {type(e).__name__}: {text[:400]} (run again with CHUNKGEN_TRACEBACK=1 for the "
        "traceback, and report it)"
    )


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode="rich" if TTY else None,  # plain, unwrapped messages in logs and CI
    help="Offline batched generation on a prefix-aware chunked KV cache.",
)
bench_app = typer.Typer(cls=_Group, no_args_is_help=True, help="Benchmarks: the attention kernel, end to end.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True, soft_wrap=not TTY)
stdout = Console(width=None if sys.stdout.isatty() else 160)  # tables stay readable when piped

# Exit codes: 0 done; 1 an error (message, no traceback); 2 a usage error (a bad option, as typer);
# 3 some rows became error records; 130 / 143 stopped by SIGINT / SIGTERM (resumable, EXIT_SIGNAL).
EXIT_ERROR = 1
EXIT_BAD_INPUT_LINES = 3


def one_line(text: str) -> str:
    """A message as one line: a library's multi-line error (a parser's caret diagram) joined up."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def fail(message: str) -> NoReturn:
    # The message is text: brackets in it ('chunkgen[eval]', a path) are not rich markup.
    err.print(f"[bold red]error:[/] {escape(one_line(message))}", highlight=False, markup=True)
    raise typer.Exit(EXIT_ERROR)


def usage(option: str, message: str) -> NoReturn:
    raise typer.BadParameter(message, param_hint=f"'{option}'")


def _version(value: bool) -> None:
    if value:
        from chunkgen import __version__

        print(f"chunkgen {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Offline batched generation on a prefix-aware chunked KV cache."""
