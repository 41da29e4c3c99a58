"""What a run says while it runs: a bar on a terminal; elsewhere plain or JSON lines, at least every
PROGRESS_EVERY_S (JSON_PROGRESS_EVERY_S), also while one long step holds the main thread."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from chunkgen.cli.boundary import TTY, err
from chunkgen.device import human_bytes
from chunkgen.progress import Meter

PROGRESS_EVERY_S = 10.0  # plain progress lines outside a terminal
JSON_PROGRESS_EVERY_S = 1.0


def json_event(event: dict) -> None:
    print(json.dumps(event), file=sys.stderr, flush=True)


class Ticker:
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


def _progress_text(p, meter: Meter, rows: bool = True) -> str:
    return f"{meter.text(rows)}, KV {human_bytes(p.kv_used_bytes)}, cache hits {100 * p.cache_hit_rate:.1f}%"


def _progress_lines(json_log: bool, total: int | None):
    """Lines from the job's progress callback (after each engine step) and, when no step has ended
    for a while, from a ticker that says which step is running and for how long."""
    every = JSON_PROGRESS_EVERY_S if json_log else PROGRESS_EVERY_S
    lock = threading.Lock()
    t0 = time.perf_counter()
    state: dict[str, Any] = {"p": None, "at": t0, "printed": float("-inf")}
    meter = Meter()

    def emit(p, now: float) -> None:
        busy = now - state["at"]  # since the last step ended (or the run began)
        elapsed = now - t0
        if json_log:
            fields = dict(p.__dict__) if p is not None else {"done": 0, "total": total}
            eta = meter.eta_s
            json_event(
                {
                    "event": "progress",
                    **fields,
                    "elapsed_s": round(elapsed, 2),
                    "step_running_s": round(busy, 2),
                    "recent_tokens_per_s": round(meter.tokens_per_s, 2),
                    "eta_s": None if eta is None else round(eta, 1),
                }
            )
        else:
            if p is None:
                of = f"/{total}" if total else ""
                line = f"progress: 0{of} rows done, {elapsed:.0f} s, first prefill wave running for {busy:.0f} s"
            else:
                line = f"progress: {_progress_text(p, meter)}, {p.errors} errors, {elapsed:.0f} s"
                if busy >= every:
                    line += f", a step running for {busy:.0f} s"
            print(line, file=sys.stderr, flush=True)
        state["printed"] = now

    def on_step(p) -> None:
        with lock:
            now = time.perf_counter()
            state["p"], state["at"] = p, now
            meter.update(p.snapshot())
            if now - state["printed"] >= every:
                emit(p, now)

    def tick() -> None:
        with lock:
            now = time.perf_counter()
            if now - state["printed"] >= every and now - t0 >= every:
                emit(state["p"], now)

    ticker = Ticker(tick, min(1.0, every / 4))
    return on_step, ticker.stop


def progress_printer(quiet: bool, json_log: bool, total: int | None):
    """(callback, stop) for progress: a bar on a terminal; elsewhere plain (or JSON) lines at least
    every PROGRESS_EVERY_S (JSON_PROGRESS_EVERY_S), also while one long step is running."""
    if quiet:
        return None, lambda: None
    if json_log or not TTY:
        return _progress_lines(json_log, total)
    progress = Progress(
        TextColumn("[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=err,
        transient=False,
    )
    progress.start()
    task = progress.add_task("run", total=None, info="")
    meter = Meter()

    def on_bar(p) -> None:
        meter.update(p.snapshot())
        progress.update(task, completed=p.done, total=p.total, info=_progress_text(p, meter, rows=False))

    return on_bar, progress.stop
