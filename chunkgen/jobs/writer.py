"""The output file's one writer. Streaming JSONL results: one line per finished request, written with one system call, and a file
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

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkgen.jobs.formats import RecordFormat, encode_record
from chunkgen.jobs.ledger import Ledger, OutputError, is_record, legacy_keys, parse_line, read_records
from chunkgen.jobs.lock import OutputLock, lock_copy, same_file
from chunkgen.jobs.requests import Job, id_key


class OutputExists(FileExistsError):
    pass


class ResultWriter:
    """The one writer of an output file: it holds the file's lock from open to close."""

    def __init__(
        self,
        path: str | Path,
        fmt: str,
        model_name: str,
        resume: bool = False,
        ordered: bool = False,
        rerun_changed: bool = False,
        id_field: str = "id",
    ) -> None:
        self.format = RecordFormat(fmt, model_name, id_field)
        self.id_field = id_field
        self.path = Path(path)
        if self.path.is_dir():
            raise OutputError(
                f"{self.path} is a directory; --out takes a file path, e.g. {self.path / 'results.jsonl'}"
            )
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
            raise OutputExists(
                f"{self.path} already has results; pass --resume to continue it, or choose another --out"
            )
        if size:
            self._repair_tail()
            self._scan()
            if self.ledger.kept() < self.ledger.n:
                dropped = self.ledger.n - self.ledger.kept()
                self._guard(lambda: self._rewrite(None), "rewrite")
                self.notes.append(
                    f"finished an interrupted rewrite of {self.path}: removed {dropped} superseded record(s)"
                )
                self._scan()
        self._check_id_field()
        self.answers = self.ledger.standing_answers()
        self._legacy = legacy_keys(self.answers)
        # (line, request hash) -> key of each answer of a row that had no id: a row that has one
        # now (ids added since) is found by it rather than answered twice. (A row whose id changed
        # to another is a row of its own; ids read from another field are refused on opening.)
        self._by_request = {
            (line, h): key
            for key, (line, h) in self.answers.items()
            if h is not None and (key.startswith("request:") or key == id_key(f"line-{line}"))
        }
        self.rekeyed = 0  # rows whose earlier answer was found under another key
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
                self.notes.append(
                    f"removed {self.target.parent / name}, left by an interrupted rewrite of "
                    f"{self.path} (the file itself is complete)"
                )

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
        for _ in read_records(self.target):  # a foreign file is refused before anything changes
            pass
        if is_record(parse_line(tail)):
            self._guard(lambda: os.write(self.lock.fd, b"\n"), "repair")
            self.notes.append(f"{self.path}: the last record had no final newline; added it")
        else:
            self._guard(lambda: os.truncate(self.target, start), "repair")
            self.notes.append(
                f"{self.path}: cut a partial last line ({size - start} bytes) left by an "
                "interrupted run; its row is answered again"
            )

    def _scan(self) -> None:
        self.ledger = Ledger()
        for _, _, rec in read_records(self.target):
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

    def _check_id_field(self) -> None:
        """Rows answered with ids from one field are not resumed with ids from another: every
        row would look new, and be answered twice."""
        if self.format.fmt == "openai":
            return
        other = {f: line for f, line in self.ledger.id_fields.items() if f != self.id_field}
        if other:
            field, line = next(iter(other.items()))
            raise OutputError(
                f"{self.path} was written with ids from the field {field!r} (line {line}'s record), and this run "
                f"reads ids from {self.id_field!r}; resume with --id-field {field}, or write to another --out"
            )

    # -- resume -------------------------------------------------------------------------------
    def answered(self, job: Job) -> bool:
        """True when an earlier run already answered this row (same id, same request; for a row
        without an id: the same request, the same occurrence of it; or the same request at the
        same line under a key the row had before its id was added)."""
        earlier = self.answers.get(job.key)
        if earlier is None and job.occurrence is not None:
            earlier = self._legacy.get(job.key)
        if earlier is None:
            other = self._by_request.get((job.line, job.request_hash))
            if other is not None and other != job.key:
                self._by_request.pop((job.line, job.request_hash))
                self.rekeyed += 1
                return True
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
                view = view[os.write(self.lock.fd, view) :]

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
            lock_copy(fd)
            os.fchmod(fd, mode)  # the umask may have narrowed it
            seen = 0
            with open(fd, "wb", closefd=False) as dst:
                for index, (_, raw, rec) in enumerate(read_records(target)):
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
