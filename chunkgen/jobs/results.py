"""Streaming JSONL results: one line per finished request, written with one system call, and a file
that a killed, stopped or repeated run never loses an answer from nor holds twice.

Every record carries chunkgen's format marker (`"chunkgen": 1`), the input line it answers and a
hash of its request (`line`, `request_hash`); a file with any other line is refused before anything
changes. An answer belongs to its row by id (ids are unique: a repeated one is an error record):
`--resume` skips a row whose id has an answer made for the same request, wherever its line moved,
and reports (or, when asked, re-answers) one whose request changed. A row without an id belongs to
its answer by its request and occurrence (`row_key`; its `line-N` id moves with the lines above
it). Error records never stand for
answers; a later record at the same line supersedes them. Superseded records are removed by an
atomic rewrite at the end of the run, and by the next `--resume` when a run died before finishing it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from chunkgen.engine.sequence import Completion, Result
from chunkgen.jobs.lock import OutputLock, same_file
from chunkgen.jobs.requests import ErrorRecord, Job, row_key

FORMAT_VERSION = 1  # the `chunkgen` field of every record; records without it (older releases) need `request_hash`


class OutputExists(FileExistsError):
    pass


class OutputError(ValueError):
    """The output file cannot be used or written; the message says why and what is safe."""


# -- records on disk -------------------------------------------------------------------------------
def _is_record(rec: Any) -> bool:
    """A line chunkgen wrote: its own fields with their types, not merely an `id` and a `text`."""
    if not isinstance(rec, dict) or rec.get("chunkgen", FORMAT_VERSION) != FORMAT_VERSION:
        return False
    line = rec.get("line")
    if "request_hash" not in rec or not isinstance(rec["request_hash"], (str, type(None))):
        return False
    if isinstance(line, bool) or not isinstance(line, int):
        return False
    if "custom_id" in rec:  # OpenAI batch output
        return ("response" in rec and isinstance(rec.get("error"), (dict, type(None)))
                and isinstance(rec["custom_id"], (str, type(None))))
    if not isinstance(rec.get("id", 0), (str, type(None))):
        return False
    return "id" in rec and (isinstance(rec.get("text"), str) or isinstance(rec.get("error"), dict))


def record_id(rec: dict[str, Any]) -> str | None:
    return rec.get("custom_id") if "custom_id" in rec else rec.get("id")


def record_key(rec: dict[str, Any]) -> str | None:
    """What a record's answer belongs to (Job.key): the row's id, or the `row_key` of a row without one."""
    key = rec.get("row_key")
    return key if isinstance(key, str) else record_id(rec)


def is_error(rec: dict[str, Any]) -> bool:
    return rec.get("error") is not None


def _foreign(path: Path, number: int, rec: Any) -> OutputError:
    if isinstance(rec, dict) and isinstance(rec.get("chunkgen"), int) and rec["chunkgen"] > FORMAT_VERSION:
        why = f"line {number} was written by a newer chunkgen (record format {rec['chunkgen']})"
    else:
        why = f"line {number} is not a chunkgen result record"
    return OutputError(f"{path}: {why}; refusing to resume into it, and nothing was changed "
                       "(is --out your queries file?)")


def _parse_line(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, a number too long to convert
        return None


def _records(path: Path) -> Iterator[tuple[int, bytes, dict[str, Any] | None]]:
    """(line number, raw line, record) for each non-blank line; record None for a last line without
    its newline that is not a whole record (a run died while writing it). Raises OutputError at the
    first line that is not chunkgen's."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            rec = _parse_line(raw)
            if not _is_record(rec):
                if _cut_record(raw, rec):
                    yield number, raw, None
                    return
                raise _foreign(path, number, rec)
            yield number, raw, rec


def _cut_record(raw: bytes, parsed: Any) -> bool:
    """A last line that a run died while writing: no newline, not JSON, and begun as every record is."""
    return not raw.endswith(b"\n") and parsed is None and raw.startswith(b'{"id": ')


class Ledger:
    """Which records of a file stand: the last answer of each id, and at each line the last record
    (an error record there is superseded by any later record for that line; an answer, only by a
    later error record for the same id and line, i.e. its request, asked again, now fails)."""

    def __init__(self) -> None:
        self.n = 0  # records added
        self.last_at_line: dict[int, tuple[int, bool, str | None]] = {}  # line -> (index, answer?, id)
        self.answers: dict[str, tuple[int, int, str | None]] = {}  # key -> (index, line, request hash)

    def add(self, rec: dict[str, Any]) -> None:
        rid, line, answer = record_key(rec), rec["line"], not is_error(rec)
        self.last_at_line[line] = (self.n, answer, rid)
        if answer and rid is not None:
            self.answers[rid] = (self.n, line, rec.get("request_hash"))
        self.n += 1

    def _answer_stands(self, rid: str, index: int, line: int) -> bool:
        last, answer, last_id = self.last_at_line[line]
        return last == index or answer or last_id != rid

    def stands(self, index: int, rec: dict[str, Any], first_new: int | None = None) -> bool:
        """Whether record number `index` (0-based, file order) is kept. With `first_new`, error records
        before it (earlier runs') go too: a run that read its whole input gave every row a new verdict."""
        rid, line = record_key(rec), rec["line"]
        if is_error(rec) or rid is None:
            return self.last_at_line[line][0] == index and (first_new is None or index >= first_new)
        return self.answers[rid][0] == index and self._answer_stands(rid, index, line)

    def kept(self, first_new: int | None = None) -> int:
        errors = sum(1 for i, answer, _ in self.last_at_line.values()
                     if not answer and (first_new is None or i >= first_new))
        answers = sum(1 for rid, (i, line, _) in self.answers.items() if self._answer_stands(rid, i, line))
        return errors + answers

    def standing_answers(self) -> dict[str, tuple[int, str | None]]:
        """key (record_key) -> (line, request hash) of every answer that stands."""
        return {rid: (line, h) for rid, (i, line, h) in self.answers.items() if self._answer_stands(rid, i, line)}


def _legacy_keys(answers: dict[str, tuple[int, str | None]]) -> dict[str, tuple[int, str | None]]:
    """Answers of id-less rows written before records carried `row_key` (id `line-N` at line N),
    under the key their rows have now: the occurrences of a request counted in line order."""
    out: dict[str, tuple[int, str | None]] = {}
    counts: dict[str, int] = {}
    for rid, (line, h) in sorted(answers.items(), key=lambda kv: kv[1][0]):
        if h is not None and rid == f"line-{line}":
            out[row_key(h, counts.get(h, 0))] = (line, h)
            counts[h] = counts.get(h, 0) + 1
    return out


def encode_record(record: dict[str, Any]) -> bytes:
    """One JSON line. Text with a lone surrogate (no UTF-8 form) is written with \\u escapes instead."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")


def _sampling(job: Job) -> dict[str, Any]:
    """The record's sampling parameters. A constraint is named by its kind and a short hash, not
    repeated in full: a tool catalogue's schema would be most of every line."""
    out = job.params.as_dict()
    for kind in ("json_schema", "regex", "grammar"):
        if out.get(kind) is not None:
            out[kind] = "sha256:" + hashlib.sha256(out[kind].encode()).hexdigest()[:16]
    return out


def _logprobs(c: Completion) -> list[dict] | None:
    return None if c.logprobs is None else [e.as_openai() for e in c.logprobs]


def _extras(c: Completion) -> dict[str, Any]:
    """A completion's optional fields in chunkgen's own records: only those the request asked for."""
    out: dict[str, Any] = {}
    if c.logprobs is not None:
        out["logprobs"] = _logprobs(c)
    if c.matched is not None:
        out["constraint_matched"] = c.matched
    return out


class RecordFormat:
    """Turns results and errors into output records: chunkgen's own lines, or OpenAI batch output.
    Separate from the writer so remote workers can format what the driver writes."""

    def __init__(self, fmt: str, model_name: str) -> None:
        self.fmt = fmt
        self.model_name = model_name

    def result_record(self, job: Job, res: Result) -> dict[str, Any]:
        if res.error is not None:
            field = job.constraint_field if res.error_field == "constraint" else "prompt"
            return self._keyed(self.error_record(ErrorRecord(job.id, job.line, field, res.error), job.request_hash), job)
        if self.fmt == "openai":
            body = {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": None if c.logprobs is None else {"content": _logprobs(c), "refusal": None},
                             "finish_reason": c.finish_reason} for i, c in enumerate(res.completions)],
                "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                          "total_tokens": res.prompt_tokens + res.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
            }
            return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": job.id,
                    "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
                    "error": None, "line": job.line, "request_hash": job.request_hash, "chunkgen": FORMAT_VERSION}
        rec: dict[str, Any] = {"id": job.id, "line": job.line, "template": job.template, "text": res.text,
                               "finish_reason": res.finish_reason,
                               "usage": {"prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                                         "completion_tokens": res.completion_tokens},
                               "sampling": _sampling(job), "request_hash": job.request_hash,
                               "chunkgen": FORMAT_VERSION, **_extras(res.completions[0])}
        if len(res.completions) > 1:
            rec["completions"] = [{"text": c.text, "finish_reason": c.finish_reason, **_extras(c)}
                                  for c in res.completions]
        return self._keyed(rec, job)

    @staticmethod
    def _keyed(rec: dict[str, Any], job: Job) -> dict[str, Any]:
        """A row without an id: its record also names the request and occurrence it answers."""
        if job.occurrence is not None:
            rec["row_key"] = job.key
        return rec

    def error_record(self, err: ErrorRecord, request_hash: str | None = None) -> dict[str, Any]:
        if self.fmt == "openai":
            return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": err.id, "response": None,
                    "error": {"code": "invalid_request", "line": err.line, "field": err.field,
                              "message": err.message},
                    "line": err.line, "request_hash": request_hash, "chunkgen": FORMAT_VERSION}
        return {"id": err.id, "line": err.line, "error": {"field": err.field, "message": err.message},
                "request_hash": request_hash, "chunkgen": FORMAT_VERSION}


class ResultWriter(RecordFormat):
    """The one writer of an output file: it holds the file's lock from open to close."""

    def __init__(self, path: str | Path, fmt: str, model_name: str, resume: bool = False,
                 ordered: bool = False, rerun_changed: bool = False) -> None:
        super().__init__(fmt, model_name)
        self.path = Path(path)
        if self.path.is_dir():
            raise OutputError(f"{self.path} is a directory; --out takes a file path, e.g. {self.path / 'results.jsonl'}")
        self.notes: list[str] = []  # repairs made on opening, for the user to read
        self.rerun_changed = rerun_changed
        self.changed: list[str] = []  # ids answered before, whose request differs now
        self.ordered = ordered
        self._buffer: dict[int, bytes | None] = {}
        self._next = 0
        self._failed = False
        self.closed = False
        self.lock = self._guard(lambda: OutputLock(self.path).acquire(), "open")
        try:
            self._open(resume)
        except BaseException:
            self.lock.release()
            raise

    @property
    def target(self) -> Path:
        """The file written (the output's name with symlinks resolved)."""
        return self.lock.path

    def _open(self, resume: bool) -> None:
        self._remove_leftovers()
        self.ledger = Ledger()
        size = os.fstat(self.lock.fd).st_size
        if size and not resume:
            raise OutputExists(f"{self.path} already has results; pass --resume to continue it, or choose another --out")
        if size:
            self._repair_tail()
            self._scan()
            if self.ledger.kept() < self.ledger.n:
                dropped = self.ledger.n - self.ledger.kept()
                self._guard(lambda: self._rewrite(None), "rewrite")
                self.notes.append(f"finished an interrupted rewrite of {self.path}: removed {dropped} "
                                  "superseded record(s)")
                self._scan()
        self.answers = self.ledger.standing_answers()
        self._legacy = _legacy_keys(self.answers)
        self._first_new = self.ledger.n  # 0: a new file, where no record can supersede another

    def _remove_leftovers(self) -> None:
        """Temporary files of a rewrite that died (SIGKILL, power loss): copies, never the only data."""
        prefix = f".{self.target.name}.compact-"
        for name in os.listdir(self.target.parent):
            if name.startswith(prefix):
                try:
                    os.unlink(self.target.parent / name)
                except FileNotFoundError:
                    continue
                self.notes.append(f"removed {self.target.parent / name}, left by an interrupted rewrite of "
                                  f"{self.path} (the file itself is complete)")

    def _repair_tail(self) -> None:
        """A last line without its newline: kept (newline added) when it is a whole record, else cut."""
        size = os.fstat(self.lock.fd).st_size
        start = max(0, size - 1)
        if os.pread(self.lock.fd, 1, start) == b"\n":
            return
        while start > 0:  # find the last line's start, a block at a time
            block = os.pread(self.lock.fd, min(65536, start), max(0, start - 65536))
            cut = block.rfind(b"\n")
            if cut >= 0:
                start = start - len(block) + cut + 1
                break
            start -= len(block)
        tail = os.pread(self.lock.fd, size - start, start)
        if not tail.strip():
            return
        for _ in _records(self.target):  # a foreign file is refused before anything changes
            pass
        if _is_record(_parse_line(tail)):
            self._guard(lambda: os.write(self.lock.fd, b"\n"), "repair")
            self.notes.append(f"{self.path}: the last record had no final newline; added it")
        else:
            self._guard(lambda: os.truncate(self.target, start), "repair")
            self.notes.append(f"{self.path}: cut a partial last line ({size - start} bytes) left by an "
                              "interrupted run; its row is answered again")

    def _scan(self) -> None:
        self.ledger = Ledger()
        for _, _, rec in _records(self.target):
            self.ledger.add(rec)

    def _guard(self, action: Callable[[], Any], what: str):
        try:
            return action()
        except OSError as exc:
            self._failed = True
            raise OutputError(
                f"cannot {what} {self.path}: {exc.strerror or exc}; every record written before this "
                "point is kept, and a rerun with --resume continues from it"
            ) from None

    # -- resume -------------------------------------------------------------------------------
    def answered(self, job: Job) -> bool:
        """True when an earlier run already answered this row (same id, same request; for a row
        without an id: the same request, the same occurrence of it)."""
        earlier = self.answers.get(job.key)
        if earlier is None and job.occurrence is not None:
            earlier = self._legacy.get(job.key)
        if earlier is None:
            return False
        line, request_hash = earlier
        if request_hash == job.request_hash or (request_hash is None and line == job.line):
            return True
        self.changed.append(job.id)
        return not self.rerun_changed

    # -- writing ------------------------------------------------------------------------------
    def write(self, record: dict[str, Any], index: int | None = None) -> None:
        """Write now (completion order), or hold until every earlier index is written (--ordered)."""
        line = encode_record(record)
        if not self.ordered or index is None:
            self._emit(line, record)
        else:
            self._hold((line, record), index)

    def skip(self, index: int) -> None:
        """An index with nothing to write (answered in an earlier run): frees the ordered queue."""
        if self.ordered:
            self._hold(None, index)

    def _hold(self, item: tuple[bytes, dict] | None, index: int) -> None:
        self._buffer[index] = item
        while self._next in self._buffer:
            item = self._buffer.pop(self._next)
            if item is not None:
                self._emit(*item)
            self._next += 1

    def _emit(self, line: bytes, record: dict[str, Any]) -> None:
        if self._failed:
            raise OutputError(f"{self.path} can no longer be written (an earlier write failed)")
        self._check_named()

        def put() -> None:
            view = memoryview(line)
            while view:  # one call for a whole line but on a full disk; a killed run cuts at most this line
                view = view[os.write(self.lock.fd, view):]
        self._guard(put, "write to")
        if self._first_new:
            self.ledger.add(record)
        else:  # one record per input line: only the count is needed, not a ledger the size of the job
            self.ledger.n += 1

    def _check_named(self) -> None:
        if not self.lock.still_named():
            self._failed = True
            raise OutputError(
                f"{self.path} was deleted, moved or replaced (or its directory was) while this run was "
                "writing it; stopped, since answers written now would be lost. Rerun, with --resume if the "
                "file is back where it was"
            )

    def close(self, complete: bool = False, rewrite: bool = True) -> None:
        """Writes what --ordered still holds, syncs, and removes superseded records. `complete`: the
        run gave every row of its input a record or a skip, so earlier runs' error records are void.
        `rewrite=False` (stopping at once) leaves superseded records for the next --resume to remove."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._failed:
                return
            for i in sorted(self._buffer):
                item = self._buffer.pop(i)
                if item is not None:
                    self._emit(*item)
            self._guard(lambda: os.fsync(self.lock.fd), "flush")
            self._check_named()
            first_new = self._first_new if complete else None
            if rewrite and self._first_new and self.ledger.kept(first_new) < self.ledger.n:
                self._guard(lambda: self._rewrite(first_new), "rewrite")
            if self.lock.created and self.ledger.n == 0:
                self.target.unlink(missing_ok=True)  # e.g. the model failed to load: leave nothing behind
        finally:
            self.lock.release()

    def _rewrite(self, first_new: int | None) -> None:
        """The file without its superseded records, atomically: a copy is written, synced and renamed
        over the file (the name's target, so a symlink stays one), keeping the file's mode. The copy is
        locked before the rename, so the lock never lapses. A kill at any point leaves either the old
        file or the new one, and maybe a copy that the next run removes."""
        target = self.target
        tmp = target.with_name(f".{target.name}.compact-{os.getpid()}")
        mode = stat.S_IMODE(os.fstat(self.lock.fd).st_mode)
        fd: int | None = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, mode)  # the umask may have narrowed it
            seen = 0
            with open(fd, "wb", closefd=False) as dst:
                for index, (_, raw, rec) in enumerate(_records(target)):
                    if rec is not None and self.ledger.stands(index, rec, first_new):
                        dst.write(raw if raw.endswith(b"\n") else raw + b"\n")
                    seen += rec is not None
            if seen != self.ledger.n:  # the file is not the one the ledger describes: keep it as it is
                raise RuntimeError(f"{target} holds {seen} records, {self.ledger.n} expected; not rewritten")
            os.fsync(fd)
            if not same_file(os.fstat(self.lock.fd), os.stat(target)):
                raise FileNotFoundError(f"{target} was replaced during the rewrite")
            os.replace(tmp, target)
            self.lock.adopt(fd)
            fd = None
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself survives a power loss
            finally:
                os.close(dir_fd)
        finally:
            if fd is not None:
                os.close(fd)
                tmp.unlink(missing_ok=True)
