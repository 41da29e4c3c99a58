"""Reading what a user or a model folder hands us without trusting its size: a file is read in
pieces up to a limit (an endless device, a sparse file or a multi-gigabyte mistake is a one-line
error, never a read that fills memory), text is named by its encoding when it is not UTF-8 (never
echoed as raw bytes), and a query file's lines are cut at a limit with the rest skipped unread.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from chunkgen.device import human_bytes

# Limits: far above any real file of each kind, far below what would hurt the machine.
TEXT_FILE_BYTES = 16 << 20  # a template, a JSON schema, a grammar, a model's config or chat template
TOKENIZER_CONFIG_BYTES = 64 << 20  # tokenizer_config.json may embed a vocabulary's added tokens
ROW_BYTES = 16 << 20  # one query row (a document of a million tokens, escaped, is under 10 MiB)


class TooLarge(ValueError):
    """A file or row larger than chunkgen reads; the message names it and the limit."""


class NotText(ValueError):
    """Bytes that are not UTF-8 text; the message names the encoding when it can tell."""


def encoding_name(data: bytes) -> str | None:
    """The encoding bytes are evidently in when it is not UTF-8: a byte-order mark, or the zero
    bytes every other position that ASCII text in UTF-16 has; None when nothing says."""
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    head = data[:512]
    if len(head) >= 4 and (head[1::2].count(0) > len(head) // 4 or head[0::2].count(0) > len(head) // 4):
        return "UTF-16"
    if b"\x00" in head:
        return "binary (it holds zero bytes: a sparse, binary or compressed file)"
    return None


def bad_byte(data: bytes, start: int, line: int = 1) -> str:
    """Where a decode failed, as an editor shows it: "line L has the byte 0xE9 at column C" for
    the byte at `start` of data whose first line is number `line`."""
    line_start = data.rfind(b"\n", 0, start) + 1
    line += data.count(b"\n", 0, start)
    return f"line {line} has the byte {data[start]:#04x} at column {start - line_start + 1}"


def not_utf8_rows(where: str, location: str) -> NotText:
    """A query file whose rows are not UTF-8, at `location` (bad_byte)."""
    return NotText(
        f"{where} is not UTF-8 text ({location}; a spreadsheet or Windows export is often Latin-1 or "
        "Windows-1252); save it as UTF-8"
    )


def first_bad_line(path: Path) -> str | None:
    """bad_byte of a file's first line that is not UTF-8 (lines read bounded); None if none."""
    with open(path, "rb") as f:
        for number, raw in enumerate(lines(f), 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return bad_byte(raw, exc.start, number)
    return None


def not_utf8(data: bytes, where: str, exc: UnicodeDecodeError | None = None) -> NotText:
    """The error for bytes that do not decode: the encoding named when it shows, else the byte and
    its line and column (a Latin-1 or Windows-1252 file, most often)."""
    kind = encoding_name(data)
    if kind is not None and not kind.startswith("binary"):
        return NotText(f"{where} is {kind} text, not UTF-8; save it as UTF-8")
    if kind is not None:
        return NotText(f"{where} is not text: {kind}")
    at = f" ({bad_byte(data, exc.start)})" if exc is not None else ""
    return NotText(f"{where} is not UTF-8 text{at}; save it as UTF-8")


def check_regular(path: Path, what: str) -> None:
    """A device (/dev/zero, /dev/urandom) is an endless stream, not a file: refused by name."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # the reader says what is wrong in its own words
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise TooLarge(f"{path} is a device, not a {what} file")


def read_bytes(path: str | os.PathLike, limit: int = TEXT_FILE_BYTES, what: str = "") -> bytes:
    """The whole file, read in pieces and refused past `limit` bytes (an endless or sparse file
    stops there). Raises TooLarge, or the OSError of the read."""
    path = Path(path)
    check_regular(path, what or "text")
    pieces: list[bytes] = []
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(min(1 << 20, limit + 1 - size)):
            pieces.append(piece)
            size += len(piece)
            if size > limit:
                raise TooLarge(f"{path} is larger than {human_bytes(limit)}, more than a {what or 'text'} file holds")
    return b"".join(pieces)


def read_text(path: str | os.PathLike, limit: int = TEXT_FILE_BYTES, what: str = "") -> str:
    """The file as UTF-8 text (a UTF-8 byte-order mark dropped), bounded as `read_bytes`; raises
    TooLarge, NotText or OSError."""
    data = read_bytes(path, limit, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(data, str(path), exc) from None
    if "\x00" in text:
        raise not_utf8(data, str(path))
    return text.removeprefix("\ufeff")


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} appears twice")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook: a key given twice is a mistake, not a silent last value."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


class Overlong(bytes):
    """A line longer than the limit, in its place among the lines: its first bytes (to name its
    id when they show it), with `size` its whole length; the rest was skipped unread."""

    size: int


def lines(
    stream: BinaryIO, limit: int = ROW_BYTES, sink: Callable[[bytes], None] | None = None, skip: bool = True
) -> Iterator[bytes]:
    """The stream's lines, each whole when at most `limit` bytes long, else an Overlong; memory
    stays within `limit` whatever the stream holds. `sink` sees every byte read (a spool). With
    `skip` False the stream ends at the first Overlong (a check of a file's start reads no further)."""
    while True:
        raw = stream.readline(limit + 1)
        if not raw:
            return
        if sink is not None:
            sink(raw)
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        size = len(raw)
        head = raw[:1024]
        del raw
        while skip:
            rest = stream.readline(1 << 20)
            if sink is not None and rest:
                sink(rest)
            size += len(rest)
            if not rest or rest.endswith(b"\n"):
                break
        line = Overlong(head)
        line.size = size
        yield line
        if not skip:
            return
