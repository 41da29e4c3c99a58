"""A catalogue of user mistakes, each run through the real entry point (`python -m chunkgen`, a
subprocess): every one ends in one line on stderr and its documented exit code (README, "Exit
codes and errors"), never a traceback. Signals are sent at start-up, during the keying pass, during
decoding, once and twice in a row."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import PROMPTS, ROOT, base_args

USAGE, ERROR, INTERRUPTED = 2, 1, 130
QUESTIONS = '{"id": "a", "question": "What is 2 + 2?"}\n{"id": "b", "question": "Is 7 prime?"}\n'


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    env.pop("CHUNKGEN_TRACEBACK", None)
    env.update(extra)
    return env


def _error_lines(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if l.strip()]


@dataclass
class Mistake:
    """`args` after `run`; `setup(tmp, model)` writes the files the mistake needs and may return
    replacements for the placeholders QUERIES, OUT, MODEL, TEMPLATE, or environment variables."""

    name: str
    args: list[str]
    code: int
    says: str  # a word the one line must hold
    setup: Callable[[Path, Path], dict[str, str]] = field(default=lambda tmp, model: {})


def _file(name: str, text: str | bytes) -> Callable[[Path, Path], dict[str, str]]:
    def setup(tmp: Path, model: Path) -> dict[str, str]:
        path = tmp / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return {"QUERIES": str(path)}

    return setup


def _model_copy(edit: Callable[[Path], None]) -> Callable[[Path, Path], dict[str, str]]:
    def setup(tmp: Path, model: Path) -> dict[str, str]:
        copy = tmp / "model"
        shutil.copytree(model, copy)
        edit(copy)
        return {"MODEL": str(copy)}

    return setup


def _no_chat_template(folder: Path) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def _architecture(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["WhisperForConditionalGeneration"], model_type="whisper")
    (folder / "config.json").write_text(json.dumps(config))


def _out_file(text: str) -> Callable[[Path, Path], dict[str, str]]:
    def setup(tmp: Path, model: Path) -> dict[str, str]:
        (tmp / "out.jsonl").write_text(text)
        return {}

    return setup


def _fifo(tmp: Path, model: Path) -> dict[str, str]:
    os.mkfifo(tmp / "fifo")
    return {"OUT": str(tmp / "fifo")}


def _template(text: str) -> Callable[[Path, Path], dict[str, str]]:
    def setup(tmp: Path, model: Path) -> dict[str, str]:
        (tmp / "t.toml").write_text(text)
        return {"TEMPLATE": str(tmp / "t.toml")}

    return setup


def _tmpdir_file(tmp: Path, model: Path) -> dict[str, str]:
    (tmp / "not-a-folder").write_text("")
    return {"ENV_TMPDIR": str(tmp / "not-a-folder")}


CSV = "id,question\na,What is 2 + 2?\nb,Is 7 prime?\n"
MISTAKES = [
    # options (typer's own checks and chunkgen's), exit 2
    Mistake("no --queries", ["--out", "OUT"], USAGE, "--queries"),
    Mistake("unknown option", ["--queries", "QUERIES", "--out", "OUT", "--colour", "red"], USAGE, "--colour"),
    Mistake("max-new-tokens not a number", ["--max-new-tokens", "many"], USAGE, "--max-new-tokens"),
    Mistake("max-new-tokens zero", ["--max-new-tokens", "0"], USAGE, "--max-new-tokens"),
    Mistake("temperature negative", ["--temperature", "-1"], USAGE, "--temperature"),
    Mistake("top-p above one", ["--top-p", "2"], USAGE, "--top-p"),
    Mistake("logprobs above 20", ["--logprobs", "50"], USAGE, "--logprobs"),
    Mistake("chunk size not a multiple of 16", ["--chunk-size", "20"], USAGE, "--chunk-size"),
    Mistake("kv-memory unreadable", ["--kv-memory", "lots"], USAGE, "--kv-memory"),
    Mistake("max-batch unreadable", ["--max-batch", "lots"], USAGE, "--max-batch"),
    Mistake("max-batch zero", ["--max-batch", "0"], USAGE, "--max-batch"),
    Mistake("kv-memory above the machine's memory", ["--kv-memory", "64TiB"], USAGE, "memory"),
    Mistake("kv-memory below one chunk", ["--kv-memory", "1KiB"], USAGE, "--kv-memory"),
    Mistake("dtype unknown", ["--dtype", "fp8"], USAGE, "--dtype"),
    Mistake("device unknown", ["--device", "tpu"], USAGE, "--device"),
    Mistake("format unknown", ["--format", "yaml"], USAGE, "--format"),
    Mistake("order unknown", ["--order", "random"], USAGE, "--order"),
    Mistake("rerun-changed without resume", ["--rerun-changed"], USAGE, "--resume"),
    Mistake("two constraints", ["--regex", "[0-9]+", "--json-schema", "QUERIES"], USAGE, "--json-schema"),
    Mistake("json schema file missing", ["--json-schema", "/nonexistent/schema.json"], USAGE, "--json-schema"),
    Mistake("json schema not JSON", ["--json-schema", "QUERIES"], USAGE, "not valid JSON", _file("s.json", "{oops")),
    Mistake("regex that does not compile", ["--regex", "(unclosed"], USAGE, "--regex"),
    Mistake("shard out of range", ["--shard", "3/2"], USAGE, "--shard"),
    Mistake("shard of standard input", ["--shard", "0/2", "--queries", "-"], USAGE, "standard input"),
    # the files named, exit 2
    Mistake("queries is a folder", ["--queries", "TMP"], USAGE, "directory"),
    Mistake("queries missing", ["--queries", "/nonexistent/q.jsonl"], USAGE, "not found"),
    Mistake("out is a folder", ["--out", "TMP"], USAGE, "directory"),
    Mistake("out is the queries file", ["--out", "QUERIES"], USAGE, "queries file"),
    Mistake("out is a device", ["--out", "/dev/full"], USAGE, "device"),
    Mistake("out is a FIFO", ["--out", "OUT"], USAGE, "FIFO", _fifo),
    Mistake("out in a missing folder", ["--out", "/nonexistent/folder/out.jsonl"], USAGE, "does not exist"),
    Mistake("CSV content in a .jsonl file", [], USAGE, "CSV with the header id, question", _file("q.jsonl", CSV)),
    Mistake("TSV content", [], USAGE, "TSV", _file("q.jsonl", CSV.replace(",", "\t"))),
    Mistake(
        "one JSON array",
        [],
        USAGE,
        "JSON array",
        _file("q.jsonl", json.dumps([{"id": "a", "question": "x"}], indent=2)),
    ),
    Mistake(
        "a placeholder no row fills",
        ["--template", "TEMPLATE"],
        USAGE,
        "did you mean 'message'",
        lambda tmp, model: {
            **_template('system = "S"\nuser = "{mesage}"\n')(tmp, model),
            **_file("q.jsonl", '{"id": "a", "message": "hi"}\n')(tmp, model),
        },
    ),
    # errors, exit 1
    Mistake("template missing", ["--template", "/nonexistent/t.toml"], ERROR, "t.toml"),
    Mistake("template not TOML", ["--template", "TEMPLATE"], ERROR, "t.toml", _template("system = [unclosed\n")),
    Mistake("template rows without a template", ["--template", ""], ERROR, "--template"),
    Mistake("empty queries file", [], ERROR, "no rows", _file("q.jsonl", "\n\n")),
    Mistake("model folder missing", ["--model", "/nonexistent/model"], ERROR, "/nonexistent/model"),
    Mistake(
        "model without a tokenizer",
        [],
        ERROR,
        "tokenizer",
        _model_copy(lambda d: [p.unlink() for p in d.glob("tokenizer*")]),
    ),
    Mistake("model without a chat template", [], ERROR, "--no-chat-template", _model_copy(_no_chat_template)),
    Mistake(
        "model without weights", [], ERROR, "no weights", _model_copy(lambda d: (d / "model.safetensors").unlink())
    ),
    Mistake("model of another architecture", [], ERROR, "Whisper", _model_copy(_architecture)),
    Mistake(
        "truncated weights",
        [],
        ERROR,
        "cannot load the weights",
        _model_copy(lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:4096])),
    ),
    Mistake("output exists without --resume", [], ERROR, "--resume", _out_file('{"x": 1}\n')),
    Mistake(
        "output not chunkgen's, with --resume",
        ["--resume"],
        ERROR,
        "not a chunkgen result record",
        _out_file('{"id": "a", "text": "hand-written"}\n'),
    ),
    Mistake(
        "TMPDIR missing",
        ["--order", "prefix"],
        ERROR,
        "TMPDIR",
        lambda tmp, model: {"ENV_TMPDIR": str(tmp / "missing")},
    ),
    Mistake("TMPDIR is a file", ["--order", "prefix"], ERROR, "TMPDIR", _tmpdir_file),
    Mistake("standard input empty", ["--queries", "-"], ERROR, "standard input held no rows"),
]


def _command(m: Mistake, tmp: Path, model: Path) -> tuple[list[str], dict[str, str]]:
    (tmp / "q.jsonl").write_text(QUESTIONS)
    values = {
        "QUERIES": str(tmp / "q.jsonl"),
        "OUT": str(tmp / "out.jsonl"),
        "MODEL": str(model),
        "TEMPLATE": str(PROMPTS / "arithmetic_cot.toml"),
        "TMP": str(tmp),
    }
    values.update(m.setup(tmp, model))
    env = _env(**{k[4:]: v for k, v in values.items() if k.startswith("ENV_")})
    base = {
        "--queries": "QUERIES",
        "--out": "OUT",
        "--model": "MODEL",
        "--template": "TEMPLATE",
        "--max-new-tokens": "4",
        "--kv-memory": "64MiB",
        "--chunk-size": "16",
        "--dtype": "fp32",
    }
    given = dict(zip(m.args[::2], m.args[1::2]))
    if m.name == "no --queries":
        base.pop("--queries")
    args: list[str] = []
    for option, value in base.items():
        if option not in given:
            args += [option, value]
    args += m.args
    args = [values.get(a, a) for a in args]
    if "--template" in args and args[args.index("--template") + 1] == "":
        i = args.index("--template")
        del args[i : i + 2]
    return [sys.executable, "-m", "chunkgen", "run", "--quiet", *args], env


def test_the_catalogue_holds_at_least_forty_mistakes():
    assert len(MISTAKES) >= 40 and len({m.name for m in MISTAKES}) == len(MISTAKES)


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_each_mistake_is_one_line_and_its_exit_code(mistake: Mistake, tiny_model, tmp_path):
    cmd, env = _command(mistake, tmp_path, tiny_model)
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=tmp_path
    )
    lines = _error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.returncode == mistake.code, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and mistake.says in lines[0], lines[0]
    assert not (tmp_path / "out.jsonl").exists() or mistake.setup.__qualname__.startswith("_out_file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; run the tests as a user")
def test_an_output_in_a_read_only_folder_is_refused_before_the_model_loads(tiny_model, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        cmd, env = _command(Mistake("read-only", ["--out", str(folder / "out.jsonl")], USAGE, ""), tmp_path, tiny_model)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        folder.chmod(0o755)
    assert proc.returncode == USAGE and "not writable" in proc.stderr and len(_error_lines(proc.stderr)) == 1


def test_an_output_locked_by_another_process_is_one_line(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("")
    with out.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        cmd, env = _command(Mistake("locked", ["--resume"], ERROR, ""), tmp_path, tiny_model)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == ERROR and len(_error_lines(proc.stderr)) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


# -- signals -----------------------------------------------------------------------------------------
def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored, and a child inherits that: the tests send
    # SIGINT as a terminal would, to a process that has Python's own handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        env=env,
        preexec_fn=_default_sigint,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}: {''.join(seen)}")


# The child holds still inside the import of the command line's modules (as the import of torch
# does for seconds), says so, and is interrupted there: no sleep has to guess where start-up is.
_SLOW_IMPORT = """
import importlib.abc, sys, time
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "chunkgen.cli":
            print("importing", flush=True)
            time.sleep(60)
        return None
sys.meta_path.insert(0, Slow())
sys.argv = ["chunkgen", *sys.argv[1:]]
from chunkgen.entry import main
main()
"""


def test_sigint_while_starting_is_one_line(tmp_path):
    proc = _start([sys.executable, "-c", _SLOW_IMPORT, "run", "--queries", "x", "--out", str(tmp_path / "o")], _env())
    assert proc.stdout.readline().strip() == "importing"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == INTERRUPTED and "Traceback" not in stderr, stderr
    assert _error_lines(stderr) == ["interrupted (SIGINT) while starting; nothing was done"], stderr


def test_sigint_while_parsing_is_one_line(monkeypatch, capsys):
    """An interrupt inside option parsing (a callback reading a file, say) is said in one line; typer
    alone would end it in a silent exit 130."""
    from typer.core import TyperGroup

    from chunkgen.cli import app

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(TyperGroup, "make_context", interrupted)
    with pytest.raises(SystemExit) as stop:
        app(["run", "--queries", "x"], prog_name="chunkgen")
    assert stop.value.code == INTERRUPTED
    assert _error_lines(capsys.readouterr().err) == ["interrupted (SIGINT); nothing was written after it"]


def _many_rows(tmp: Path, n: int) -> Path:
    path = tmp / "many.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "question": f"What is {i} plus {i}?"}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize(
    "signals",
    [[signal.SIGINT], [signal.SIGINT, signal.SIGINT], [signal.SIGTERM, signal.SIGINT]],
    ids=["once", "twice", "term-then-int"],
)
def test_signals_during_the_keying_pass(signals, tiny_model, tmp_path):
    queries, out = _many_rows(tmp_path, 20_000), tmp_path / "out.jsonl"
    run = base_args(tiny_model, out, queries, quiet=None, max_new_tokens=4, order="prefix")
    cmd = [sys.executable, "-m", "chunkgen", *run]
    proc = _start(cmd, _env())
    _wait_for_line(proc, "--order prefix: every row is read")
    time.sleep(0.5)
    for s in signals:
        proc.send_signal(s)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[signals[0]], stderr
    assert "--resume" in stderr.strip().splitlines()[-1]
    # The head of a long file is answered while the pass still runs, so a stop may come after some
    # rows are done: what is on disk is whole rows, each once, and the rest is left to --resume.
    text = out.read_text() if out.exists() else ""
    assert not text or text.endswith("\n")
    done = [json.loads(line) for line in text.splitlines()]
    ids = [row["id"] for row in done]
    assert len(ids) == len(set(ids)) < 20_000
    assert all(isinstance(row.get("text"), str) for row in done)


def test_two_signals_while_decoding_stop_and_resume_finishes_every_row_once(tiny_model, tmp_path):
    queries, out = _many_rows(tmp_path, 40), tmp_path / "out.jsonl"
    run = base_args(tiny_model, out, queries, quiet=None, max_new_tokens=24, order="input", max_batch=4)
    cmd = [sys.executable, "-m", "chunkgen", *run]
    proc = _start(cmd, _env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and out.stat().st_size):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == INTERRUPTED and "Traceback" not in stderr, stderr
    # The first signal stops after the current step; the second stops at once, unless the run had
    # already stopped by then: either way the last line says so and how to go on.
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped") and "--resume" in last, stderr
    res = subprocess.run(cmd + ["--resume"], env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    ids = [json.loads(l)["id"] for l in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(40))


def test_a_device_out_of_memory_is_one_line_that_says_what_to_lower(tiny_model, tmp_path, monkeypatch):
    """A KV budget the device cannot hold is refused at load with what it has free (the GPU's
    allocator raises torch's OutOfMemoryError, faked here); an OOM later, as a prefill wave's
    activations, names the options that lower it rather than asking for a report."""
    import torch

    from chunkgen.cli.boundary import unexpected_text
    from tests.helpers import base_args, run_cli

    oom = "CUDA out of memory. Tried to allocate 64.00 GiB. GPU 0 has a total capacity of 79.18 GiB"
    real_empty = torch.empty

    def empty(*shape, **kwargs):  # the pool's K and V are the only 5-dimensional tensors
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if len(dims) == 5:
            raise torch.cuda.OutOfMemoryError(oom)
        return real_empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    res = run_cli(*base_args(tiny_model, tmp_path / "out.jsonl"))
    assert res.exit_code == 1
    lines = _error_lines(res.output)
    assert len(lines) == 1 and "does not fit" in lines[0] and "--kv-memory" in lines[0], res.output
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()

    text = unexpected_text(torch.cuda.OutOfMemoryError(oom + ". Of the allocated memory ..."))
    assert "Tried to allocate 64.00 GiB" in text and "--max-batch" in text and "report" not in text


# The child's model load holds still for a minute (as a large model's does), and says when it starts.
_SLOW_LOAD = """
import sys, time
sys.argv = ["chunkgen", *sys.argv[1:]]
import chunkgen.llm as llm
real = llm.load_hf
def slow(*args, **kwargs):
    print("loading now", file=sys.stderr, flush=True)
    time.sleep(60)
    return real(*args, **kwargs)
llm.load_hf = slow
from chunkgen.entry import main
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_signal_during_the_model_load_ends_the_run_at_once(signum, tiny_model, tmp_path):
    cmd, env = _command(Mistake("load", [], 0, ""), tmp_path, tiny_model)
    proc = _start([sys.executable, "-c", _SLOW_LOAD, *cmd[3:]], env)
    _wait_for_line(proc, "loading now")
    t0 = time.monotonic()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10  # not the minute the load would take
    assert proc.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130}[signum] and "Traceback" not in stderr
    lines = [l for l in stderr.splitlines() if l.strip() and l.strip() != "loading now"]
    assert len(lines) == 1 and "while the model loaded" in lines[0], stderr
    assert not (tmp_path / "out.jsonl").exists()


_SLOW_CHECK = """
import sys, time
sys.argv = ["chunkgen", *sys.argv[1:]]
import chunkgen.cli.run as run
def slow(*args, **kwargs):
    print("checking now", file=sys.stderr, flush=True)
    time.sleep(60)
run.check_tokenizer = slow
from chunkgen.entry import main
main()
"""


def test_sigterm_during_the_checks_before_the_load_is_one_line(tiny_model, tmp_path):
    """A chat template's check, a GGUF's conversion: SIGTERM there is said, never a silent death."""
    cmd, env = _command(Mistake("check", [], 0, ""), tmp_path, tiny_model)
    proc = _start([sys.executable, "-c", _SLOW_CHECK, *cmd[3:]], env)
    _wait_for_line(proc, "checking now")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert _error_lines(stderr) == ["interrupted (SIGTERM); nothing was written after it"], stderr
