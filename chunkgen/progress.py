"""How far a run is, said the same way by `chunkgen run` and `LLM.generate`: rows done of the total,
prompt tokens prefilled of those queued (the only thing that moves before the first answer), the
generation rate over the last RECENT_S seconds (not since the start, which the load and the first
prefill drag down) and the time left at the recent pace of answers."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass

RECENT_S = 20.0  # the window of the recent rates


@dataclass
class Snapshot:
    """What an engine and its job have done so far (counters only ever grow)."""

    done: int  # rows finished (answered, failed or skipped)
    total: int | None  # rows in all, when known
    generated_tokens: int
    prompt_tokens_done: int  # prompt tokens admitted (from the cache or computed)
    prompt_tokens_queued: int  # prompt tokens of every row given to the engine so far
    running: int  # sequences in the batch now


class Meter:
    """Recent rates and the time left from a stream of snapshots."""

    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self._t0 = clock()
        self._marks: deque[tuple[float, int, int]] = deque()  # (time, generated tokens, rows done)
        self.last: Snapshot | None = None

    def update(self, snap: Snapshot) -> None:
        now = self._clock()
        self.last = snap
        self._marks.append((now, snap.generated_tokens, snap.done))
        while len(self._marks) > 2 and now - self._marks[1][0] >= RECENT_S:
            self._marks.popleft()  # keep one mark at least RECENT_S old, for a full window

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def _recent(self) -> tuple[float, int, int]:
        """(seconds, tokens, rows) over the recent window."""
        if len(self._marks) < 2:
            return 0.0, 0, 0
        (t0, g0, d0), (t1, g1, d1) = self._marks[0], self._marks[-1]
        return t1 - t0, g1 - g0, d1 - d0

    @property
    def tokens_per_s(self) -> float:
        seconds, tokens, _ = self._recent()
        return tokens / seconds if seconds > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the recent pace of finished rows (the whole run's pace while the recent
        window saw none finish); None before the first row finishes or without a total."""
        snap = self.last
        if snap is None or snap.total is None or snap.done == 0:
            return None
        left = max(0, snap.total - snap.done)
        seconds, _, rows = self._recent()
        if rows > 0 and seconds > 0:
            return left * seconds / rows
        return left * self.elapsed_s / snap.done

    def text(self, rows: bool = True) -> str:
        """One line: rows (unless a bar shows them), prefill (until the first answers), rate, batch
        and time left."""
        snap = self.last
        if snap is None:
            return "starting"
        parts = []
        if rows:
            parts.append(f"{snap.done}/{snap.total} rows done" if snap.total is not None else f"{snap.done} rows done")
        if snap.prompt_tokens_done < snap.prompt_tokens_queued and snap.done == 0:
            parts.append(f"prefill {snap.prompt_tokens_done}/{snap.prompt_tokens_queued} prompt tokens")
        parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if snap.running:
            parts.append(f"batch {snap.running}")
        eta = self.eta_s
        if eta is not None:
            parts.append(f"ETA {format_seconds(eta)}")
        return ", ".join(parts)


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}:{seconds:02d}"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class GenerateBar:
    """`LLM.generate`'s progress: a rich bar on a terminal (stderr), nothing elsewhere."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.meter = Meter()
        self._progress = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task("generate", total=total, info="")
        self._progress.start()

    def update(self, snap: Snapshot) -> None:
        self.meter.update(snap)
        if self._progress is not None:
            self._progress.update(self._task, completed=snap.done, info=self.meter.text(rows=False))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
