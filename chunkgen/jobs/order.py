"""Prefix order: rows answered so that rows sharing a prompt prefix run together.

A file with more distinct prefixes than the KV cache holds, interleaved (documents with a few
questions each, shuffled), loses its cache hits in file order: by the time a row's siblings come,
its prefix has been evicted. Ordering the whole file by prompt prefix makes each shared prefix
prefilled once, while it is hot.

The ordering is an external sort that never holds rows: a first pass keys each row as it streams
and keeps only a small key (chained hashes of the first pieces of its prompt's text) with the row's
byte offset; sorted runs go to disk beyond a bound; a merge then re-reads the rows by offset in key
order. Standard input, which cannot be re-read, is spooled to a temporary file as it is read.

The key is taken from the messages' text, not their tokens: the chat template renders the same
leading messages to the same leading text, whose tokens are the same (up to the last few at the
point where two prompts part), so text prefixes group rows as token prefixes do, and keying costs a
hash of a few KB per row instead of rendering and tokenizing a prompt of thousands of tokens.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import os
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from chunkgen import bounded
from chunkgen.jobs.requests import STDIN, ErrorRecord, Job, read_rows

KEY_CHUNKS = 16  # pieces of the prompt the key tells apart: rows agreeing on more stay in file order
# Keying a large file takes a while (about 90 us a row: 200,000 rows, 17 s on a 2-core Zen 3), and
# no answer would come before it ends. So once HEAD_AFTER rows are keyed and more remain, the first
# HEAD_ROWS rows are handed on in file order, and from then on every SAMPLE_EVERY-th row keyed is
# handed on as soon as it is keyed: the engine is fed rows throughout the pass (each row it takes
# costs SAMPLE_EVERY rows of keying), never idle while the pass runs alone, and the first answers
# come after the model's load and the first wave, not after the pass. The price: at most HEAD_ROWS
# rows and one row in SAMPLE_EVERY not in prefix order (such a row whose prefix a later row shares
# may have it computed twice). A file of at most HEAD_AFTER rows (keyed in a fraction of a second)
# is ordered whole. Counts, not times, decide which rows go first, so inspect-tree foresees the
# order a run takes.
HEAD_AFTER = 2048
HEAD_ROWS = 256
SAMPLE_EVERY = 64
HASH_BYTES = 8
RUN_ROWS = 1 << 18  # keys held in memory before a sorted run is written to disk (~60 MB)

Rebuild = Callable[[int, bytes], "Job | ErrorRecord | None"]  # (line number, raw line) -> the row again
ToJobs = Callable[[Iterable[tuple[int, Any]]], Iterator["Job | ErrorRecord"]]  # template_jobs, openai_jobs


def key_cuts(piece: int, depth: int) -> list[int]:
    """Where the pieces of a key end, in characters: `piece` apart for the first half of the key,
    then doubling, so the key tells prompts apart finely where they part early (a document, then
    questions on it) and coarsely over a long reach (about piece * 2^(depth/2) characters)."""
    fine = depth // 2
    return [piece * (k + 1) for k in range(fine)] + [piece * fine * 2 ** (k + 1) for k in range(depth - fine)]


def prompt_key(messages: list[dict[str, str]], piece: int, depth: int = KEY_CHUNKS) -> bytes:
    """The sort key of a chat prompt, from its text (no chat template, no tokenizer): chained hashes,
    HASH_BYTES each, of its leading messages (a system prompt, earlier turns), one piece each, then
    of the last message's text cut at key_cuts. Two keys agree on their first k entries exactly
    when the prompts agree on their first k pieces (up to hash collisions), so sorting by key walks
    the prefix tree depth first: rows sharing a system prompt together, and within them those whose
    last message starts alike; the order an LRU cache of chunks serves best.

    The chat template renders equal leading messages to an equal leading text, whose tokens are
    equal up to where two prompts part, so this groups rows as a key of their tokens would, at the
    cost of a hash of each row's text instead of rendering and tokenizing a prompt of thousands of
    tokens. Roles and contents are set apart by control characters text does not hold; the key only
    orders rows, so a text that held them could change where a row runs, never its answer."""
    if not messages:
        return b""
    *head, last = messages
    head = head[:depth]
    out, h = _head_key(tuple(f"\x1e{m.get('role', '')}\x1f{m.get('content', '')}" for m in head))
    out = bytearray(out)
    text = str(last.get("content", ""))
    start = 0
    for cut in key_cuts(piece, depth - len(head)):
        part = text[start:cut] if start else f"\x1e{last.get('role', '')}\x1f{text[:cut]}"
        h = hashlib.blake2b(h + part.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES).digest()
        out += h
        start = cut
        if cut >= len(text):
            break
    return bytes(out)


@functools.lru_cache(maxsize=64)
def _head_key(pieces: tuple[str, ...]) -> tuple[bytes, bytes]:
    """(key entries, last hash) of a prompt's leading messages: the same system prompt on every row
    of a template is hashed once."""
    out = bytearray()
    h = b""
    for part in pieces:
        h = hashlib.blake2b(h + part.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES).digest()
        out += h
    return bytes(out), h


class QueryFileChanged(RuntimeError):
    """A row read again for the prefix order is not the row read the first time."""


class TempSpaceError(RuntimeError):
    """The temporary folder (TMPDIR) filled up or cannot be written while spooling or sorting."""


def _temp_failure(exc: OSError, what: str, needed: int) -> TempSpaceError:
    folder = tempfile.gettempdir()
    return TempSpaceError(
        f"cannot write the temporary folder {folder} (TMPDIR) while {what}: {exc.strerror or exc}; it "
        f"needs about {needed / 2**20:.1f} MiB more there. Free space, set TMPDIR to a folder with room, "
        "or pass --order input (which writes nothing there; not for standard input spooled for a shard)"
    )


def sort_bytes_needed(rows: int) -> int:
    """Temporary space the prefix order's sort takes for `rows` rows: nothing while the keys fit in
    one in-memory run, else every key with its fixed fields."""
    if rows <= RUN_ROWS:
        return 0
    return rows * (_FIXED.size + HASH_BYTES * KEY_CHUNKS)


class RowFile:
    """The query file's lines, read once as a stream and then again one by one by byte offset:
    the file itself, or for standard input or any other stream that cannot be read twice (a named
    pipe, a shell's `<(...)`) a spool in a temporary file written as it is read."""

    def __init__(self, path: str, spool_dir: str | None = None) -> None:
        self.path = path
        self._spool: BinaryIO | None = None
        self._source: BinaryIO = sys.stdin.buffer if path == STDIN else open(path, "rb")
        if path == STDIN or not os.path.isfile(path):
            self._spool = tempfile.TemporaryFile(prefix="chunkgen-stdin-", dir=spool_dir)
        self._spooled = "standard input" if path == STDIN else path
        self._reader: BinaryIO | None = None
        # line number -> (offset, crc32) for lines read but not yet claimed; bounded by how far the
        # reader runs ahead of the rows (see follow)
        self._pending: dict[int, tuple[int, int]] = {}

    def lines(self) -> Iterator[bytes]:
        """Every line in order (what read_rows takes), noting where each non-blank one starts."""
        offset = 0

        def spool(raw: bytes) -> None:
            try:
                self._spool.write(raw)
            except OSError as exc:
                raise _temp_failure(exc, f"spooling {self._spooled}", max(len(raw), offset)) from None

        for number, raw in enumerate(bounded.lines(self._source, sink=spool if self._spool else None), start=1):
            if raw.strip():
                self._pending[number] = (offset, zlib.crc32(raw))
            offset += getattr(raw, "size", len(raw))  # an Overlong line: its whole length, skipped unread
            yield raw

    def follow(self, items: Iterable[Job | ErrorRecord]) -> Iterator[Job | ErrorRecord]:
        """The rows, unchanged; the offsets of lines before each row are forgotten as it passes,
        so rows filtered out, skipped or turned into error records cost nothing later."""
        for item in items:
            while self._pending:
                first = next(iter(self._pending))
                if first >= item.line:
                    break
                del self._pending[first]
            yield item

    def claim(self, line: int) -> tuple[int, int]:
        """(byte offset, crc32) of a line that passed `follow` last."""
        return self._pending.pop(line)

    def read(self, offset: int) -> bytes:
        if self._reader is None:
            if self._spool is not None:
                try:
                    self._spool.flush()
                except OSError as exc:
                    raise _temp_failure(exc, f"spooling {self._spooled}", self._spool.tell()) from None
                self._reader = self._spool
            else:
                self._reader = open(self.path, "rb")
        self._reader.seek(offset)
        return self._reader.readline()

    def close(self) -> None:
        files = {id(f): f for f in (self._source, self._reader, self._spool) if f is not None}
        for f in files.values():
            if f is not sys.stdin.buffer:
                f.close()


# An entry: (key, index, line, offset, crc, occurrence); occurrence -1 for a row with an id. On
# disk: the fixed fields, then the key's bytes.
_FIXED = struct.Struct("<qqqIqH")


class ExternalSort:
    """Sorts entries that may not fit in memory: runs of `run_rows` sorted entries are written to
    temporary files, and iteration merges them (each run read a buffer at a time)."""

    def __init__(self, run_rows: int = RUN_ROWS, spill_dir: str | None = None) -> None:
        self.run_rows = run_rows
        self.spill_dir = spill_dir
        self._buffer: list[tuple[bytes, int, int, int, int, int]] = []
        self._runs: list[BinaryIO] = []
        self.count = 0

    @property
    def spilled_runs(self) -> int:
        return len(self._runs)

    def add(self, key: bytes, index: int, line: int, offset: int, crc: int, occurrence: int = -1) -> None:
        self._buffer.append((key, index, line, offset, crc, occurrence))
        self.count += 1
        if len(self._buffer) >= self.run_rows:
            self._spill()

    def _spill(self) -> None:
        self._buffer.sort()
        pack = _FIXED.pack
        data = b"".join(pack(i, l, o, c, n, len(k)) + k for k, i, l, o, c, n in self._buffer)
        try:
            f = tempfile.TemporaryFile(prefix="chunkgen-order-", dir=self.spill_dir)
            try:
                f.write(data)
                f.flush()
            except BaseException:
                f.close()
                raise
        except OSError as exc:
            raise _temp_failure(exc, "sorting the rows' keys for --order prefix", len(data)) from None
        f.seek(0)
        self._runs.append(f)
        self._buffer = []

    @staticmethod
    def _read_run(f: BinaryIO) -> Iterator[tuple[bytes, int, int, int, int, int]]:
        reader = _FIXED.unpack
        size = _FIXED.size
        buffered = _BufferedReader(f)
        while True:
            head = buffered.take(size)
            if not head:
                return
            i, l, o, c, occ, n = reader(head)
            yield buffered.take(n), i, l, o, c, occ

    def __iter__(self) -> Iterator[tuple[bytes, int, int, int, int, int]]:
        self._buffer.sort()
        if not self._runs:
            return iter(self._buffer)
        return heapq.merge(*(self._read_run(f) for f in self._runs), self._buffer)

    def close(self) -> None:
        for f in self._runs:
            f.close()
        self._runs, self._buffer = [], []


class _BufferedReader:
    def __init__(self, f: BinaryIO, size: int = 1 << 16) -> None:
        self._f, self._size = f, size
        self._data, self._pos = b"", 0

    def take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            self._data = self._data[self._pos :] + self._f.read(max(self._size, n))
            self._pos = 0
        out = self._data[self._pos : self._pos + n]
        self._pos += len(out)
        return out


@dataclass
class OrderStats:
    rows: int = 0
    spilled_runs: int = 0
    seconds: float = 0.0  # the first pass: keying every row, keeping and sorting the keys
    head: int = 0  # rows handed on in file order while the pass ran (the head and every SAMPLE_EVERY-th)


@dataclass
class PrefixOrder:
    """How a job's rows are put in prefix order: the file they are re-read from, how a re-read
    line becomes a row again, and the memory bound of the sort."""

    rows: RowFile
    rebuild: Rebuild
    run_rows: int = RUN_ROWS
    spill_dir: str | None = None
    stats: OrderStats = field(default_factory=OrderStats)

    @classmethod
    def reading(
        cls, row_file: RowFile, rows: Iterable[tuple[int, Any]], to_jobs: ToJobs, **kwargs: Any
    ) -> tuple[PrefixOrder, Iterator[Job | ErrorRecord]]:
        """(the order, the job's rows in file order) for rows parsed from `row_file.lines()`;
        `to_jobs` turns parsed rows into jobs, the first time and when a line is read again."""

        def rebuild(line: int, raw: bytes) -> Job | ErrorRecord | None:
            return next(to_jobs((line, obj) for _, obj in read_rows([raw])), None)

        return cls(row_file, rebuild, **kwargs), row_file.follow(to_jobs(rows))

    def close(self) -> None:
        """The file the rows are re-read from (a spooled standard input is removed)."""
        self.rows.close()

    def apply(
        self, jobs: Iterable[tuple[int, Job]], chunk_size: int, should_stop: Callable[[], bool] = lambda: False
    ) -> Iterator[tuple[int, Job]]:
        """`jobs` (numbered in file order, as triage yields them) in prefix order, for a cache of
        chunks of `chunk_size` tokens. Every row is keyed (by its prompt's text: prompt_key) before
        the rows are handed on in key order; in a file of more than HEAD_AFTER rows the first
        HEAD_ROWS, then every SAMPLE_EVERY-th row keyed, go on in file order while the pass runs.
        The pass runs only as fast as the rows are taken, so it never holds the engine up. A stop
        request ends the keying pass early (the rows not handed on stay unanswered, for --resume).
        A key piece is chunk_size characters: a chunk's worth of text or less (a token is one
        character or more), so rows sharing a chunk share a piece."""
        sorter = ExternalSort(self.run_rows, self.spill_dir)
        keying = 0.0  # seconds of the pass itself, not of the engine's steps while rows were handed on
        head: list[tuple[int, Job]] | None = []  # the first rows, until handed on (None after)
        handed: set[int] = set()
        try:
            t0 = time.perf_counter()
            for n, (index, job) in enumerate(jobs, start=1):
                if should_stop():
                    return
                offset, crc = self.rows.claim(job.line)
                occurrence = -1 if job.occurrence is None else job.occurrence
                sorter.add(prompt_key(_keyed_messages(job), chunk_size), index, job.line, offset, crc, occurrence)
                if head is not None and len(head) < HEAD_ROWS:
                    head.append((index, job))
                if n <= HEAD_AFTER:
                    continue
                if head is not None:
                    handing, head = head, None
                elif n % SAMPLE_EVERY == 0:
                    handing = [(index, job)]
                else:
                    continue
                keying += time.perf_counter() - t0
                handed.update(i for i, _ in handing)
                yield from handing
                t0 = time.perf_counter()
            merged = iter(sorter)
            keying += time.perf_counter() - t0
            self.stats = OrderStats(sorter.count, sorter.spilled_runs, keying, len(handed))
            for _, index, line, offset, crc, occurrence in merged:
                if index in handed:
                    continue
                raw = self.rows.read(offset)
                item = self.rebuild(line, raw) if zlib.crc32(raw) == crc else None
                if isinstance(item, Job) and item.occurrence is not None:
                    item.occurrence = occurrence  # counted over the whole file in the first pass
                if not isinstance(item, Job):
                    raise QueryFileChanged(
                        f"{self.rows.path}: line {line} changed while the job ran (it is read twice to answer "
                        "rows in prefix order); every answer written so far is kept: rerun with --resume, "
                        "or pass --order input"
                    )
                yield index, item
        finally:
            sorter.close()


def _keyed_messages(job) -> list[dict[str, str]]:
    """A completions row's prompt keyed as one message (its text; token ids as their numbers)."""
    if job.prompt is None:
        return job.messages
    text = job.prompt if isinstance(job.prompt, str) else " ".join(map(str, job.prompt))
    return [{"role": "user", "content": text}]
