"""Where a job's rows come from: the query file (JSONL, an OpenAI batch file, CSV, or standard
input), its templates, the format, the shard of it this process answers, and the prefix order.

`JobSource` owns the file for the whole run (a CSV converted once to JSONL in a temporary folder,
standard input spooled when the prefix order reads rows again) and closes it with itself. Every
mistake it finds is an `OptionError` naming the option it came from, raised before any model loads.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkgen.bounded import TooLarge, check_regular, encoding_name, first_bad_line, not_utf8, not_utf8_rows
from chunkgen.bounded import lines as bounded_lines
from chunkgen.config import OptionError
from chunkgen.device import human_bytes
from chunkgen.jobs.order import PrefixOrder, RowFile, sort_bytes_needed
from chunkgen.jobs.requests import ErrorRecord, Job, detect_format, open_queries, openai_jobs, read_rows, template_jobs
from chunkgen.jobs.shard import Shard, ShardPlan, plan_items
from chunkgen.jobs.templates import Template, TemplateError, load_templates
from chunkgen.jobs.whole_file import FileMistake, check_encoding, check_sample, csv_to_jsonl

FORMATS = ("auto", "template", "openai")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise OptionError("--format", f"must be auto, template or openai, not {fmt!r}")


def check_queries_path(queries: str) -> None:
    if queries == "-":
        return
    path = Path(queries)
    if path.is_dir():
        raise OptionError("--queries", f"{path} is a directory; give a JSONL file (or - for standard input)")
    if not path.exists():
        raise OptionError("--queries", f"{path}: queries file not found")
    try:
        check_regular(path, "queries")
    except TooLarge as exc:
        raise OptionError(
            "--queries", f"{exc} (an endless stream); give a JSONL file, or - for standard input"
        ) from None


def count_lines(queries: str) -> int | None:
    """Rows in the file for the progress total (a pipe cannot be counted ahead)."""
    if queries == "-" or not Path(queries).is_file():
        return None
    n, last = 0, b"\n"
    with open(queries, "rb") as f:
        while block := f.read(1 << 20):
            n, last = n + block.count(b"\n"), block[-1:]
    return n + (last != b"\n")


@dataclass
class JobSource:
    """The rows of one job, validated as they are read: `items` yields a Job or an ErrorRecord per
    row (in prefix order's first pass when `prefix_order` is set)."""

    queries: str  # the file the rows are read from ("-": standard input), after any CSV conversion
    fmt: str  # "template" or "openai", detected from the first row under "auto"
    templates: dict[str, Template] | None
    items: Iterator[Job | ErrorRecord]
    prefix_order: PrefixOrder | None
    plan: ShardPlan | None = None  # with a shard: where every row of the whole file goes
    _keep: tempfile.TemporaryDirectory | None = None

    @classmethod
    def open(
        cls,
        queries: str,
        template: Path | None,
        fmt: str,
        defaults: dict[str, Any],
        id_field: str,
        prefix_order: bool = False,
        shard: Shard | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> JobSource:
        """The rows of `queries`; with `prefix_order`, re-readable by offset (standard input is
        spooled to a temporary file for that) and keyed by prefix as they are first read. With a
        `shard`, the whole file is planned first and only that shard's rows are read."""
        keep, queries = _csv_as_jsonl(queries)
        try:
            _check_start(queries)
            check_temp_space(queries, prefix_order)
            plan = None
            if shard is not None:
                planned = cls._read(queries, template, fmt, defaults, id_field, False, None)  # said once, below
                plan = plan_items(planned.items, shard.count)
            source = cls._read(queries, template, fmt, defaults, id_field, prefix_order, keep, on_note)
            source.plan = plan
            if plan is not None:
                source.items = plan.select(source.items, shard.index)
            return source
        except BaseException:
            if keep is not None:
                keep.cleanup()
            raise

    @classmethod
    def _read(
        cls,
        queries: str,
        template: Path | None,
        fmt: str,
        defaults: dict[str, Any],
        id_field: str,
        prefix_order: bool,
        keep: tempfile.TemporaryDirectory | None,
        on_note: Callable[[str], None] | None = None,
    ) -> JobSource:
        templates = _load_templates(template)
        _check_sample(queries, fmt, templates, id_field)
        try:
            row_file = RowFile(queries) if prefix_order else None
            stream = row_file.lines() if row_file else open_queries(queries)
        except OSError as exc:
            raise OptionError(
                "--queries", f"{queries}: cannot read the queries file ({exc.strerror})", usage=False
            ) from None
        rows = read_rows(stream)
        if fmt == "auto":
            fmt, rows = detect_format(rows)
        to_jobs = _row_reader(queries, fmt, templates, defaults, id_field, on_note)
        if fmt == "openai":
            templates = {}
        if row_file is None:
            return cls(queries, fmt, templates, to_jobs(rows), None, _keep=keep)
        order, items = PrefixOrder.reading(row_file, rows, to_jobs)
        return cls(queries, fmt, templates, items, order, _keep=keep)

    @functools.cached_property
    def total(self) -> int | None:
        """Rows in the file, for the progress total: counted once (a pipe cannot be counted ahead)."""
        return count_lines(self.queries)

    def close(self) -> None:
        if self.prefix_order is not None:
            self.prefix_order.close()
        if self._keep is not None:
            self._keep.cleanup()
            self._keep = None

    def __enter__(self) -> JobSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_temp_space(queries: str, ordering: bool) -> None:
    """The temporary folder the run writes to (standard input spooled and the prefix order's sorted
    runs), usable and with room for what this input needs, before the model loads."""
    if not ordering:
        return
    named = os.environ.get("TMPDIR")
    if named and not os.path.isdir(named):
        raise OptionError(
            "TMPDIR", f"TMPDIR={named} is not a folder; create it or set TMPDIR to a writable folder", usage=False
        )
    try:
        folder = tempfile.gettempdir()
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise OptionError(
            "TMPDIR",
            f"the temporary folder {named or '(TMPDIR)'} cannot be written "
            f"({exc.strerror or exc}); set TMPDIR to a writable folder",
            usage=False,
        ) from None
    if named and os.path.realpath(folder) != os.path.realpath(named):
        raise OptionError("TMPDIR", f"TMPDIR={named} cannot be written; set TMPDIR to a writable folder", usage=False)
    needed = sort_bytes_needed(count_lines(queries) or 0)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise OptionError(
            "TMPDIR",
            f"the temporary folder {folder} (TMPDIR) has {human_bytes(free)} free and "
            f"--order prefix needs about {human_bytes(needed)} there for this file's sort "
            "keys; free space there, set TMPDIR to a folder with room, or pass --order input",
            usage=False,
        )


def _csv_as_jsonl(queries: str) -> tuple[tempfile.TemporaryDirectory | None, str]:
    """A .csv queries file (header row = field names) as the JSONL file the run reads: written once
    to a temporary folder that the source removes when it closes."""
    if queries == "-" or Path(queries).suffix.lower() != ".csv" or not Path(queries).is_file():
        return None, queries
    folder = tempfile.TemporaryDirectory(prefix="chunkgen-csv-")
    target = Path(folder.name) / (Path(queries).stem + ".jsonl")
    try:
        csv_to_jsonl(Path(queries), target)
    except UnicodeDecodeError:
        folder.cleanup()
        with open(queries, "rb") as f:
            head = f.read(4096)
        where = first_bad_line(Path(queries))
        if encoding_name(head) is not None or where is None:
            raise OptionError("--queries", str(not_utf8(head, queries))) from None
        raise OptionError("--queries", str(not_utf8_rows(queries, where))) from None
    except OSError:
        folder.cleanup()
        raise
    except Exception as exc:  # csv.Error: e.g. a field larger than the csv module takes
        folder.cleanup()
        raise OptionError("--queries", f"{queries}: cannot be read as CSV ({exc})") from None
    return folder, str(target)


def _check_start(queries: str) -> None:
    """A queries file without a single row, or one that is not UTF-8 text (UTF-16, a sparse or
    binary file), is refused from its first line (standard input is checked at the end)."""
    if queries == "-" or not Path(queries).is_file():
        return
    with open(queries, "rb") as f:
        first = next((line for line in bounded_lines(f, skip=False) if line.strip()), None)
    if first is None:
        raise OptionError("--queries", f"{queries} holds no rows (it is empty or blank); nothing to run", usage=False)
    try:
        check_encoding(Path(queries), first)
    except FileMistake as exc:
        raise OptionError("--queries", str(exc)) from None


def _load_templates(template: Path | None) -> dict[str, Template] | None:
    if template is None:
        return None
    try:
        return load_templates(template)
    except TemplateError as exc:
        raise OptionError("--template", str(exc), usage=False) from None


def _check_sample(queries: str, fmt: str, templates: dict[str, Template] | None, id_field: str) -> None:
    if queries == "-" or not Path(queries).is_file():
        return
    try:
        check_sample(Path(queries), fmt, templates, id_field)
    except FileMistake as exc:
        raise OptionError("--queries", str(exc)) from None
    except OSError as exc:
        raise OptionError(
            "--queries", f"{queries}: cannot read the queries file ({exc.strerror})", usage=False
        ) from None


def _row_reader(
    queries: str,
    fmt: str,
    templates: dict[str, Template] | None,
    defaults: dict[str, Any],
    id_field: str,
    on_note: Callable[[str], None] | None = None,
) -> Callable:
    if fmt == "openai":
        return lambda rows: openai_jobs(rows, defaults)
    if templates is None:
        raise OptionError(
            "--template",
            f"{queries} holds template rows: pass --template (a .toml file or a directory of them)",
            usage=False,
        )
    return lambda rows: template_jobs(rows, templates, defaults, id_field, on_note)
