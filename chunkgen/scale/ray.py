"""One job over a Ray cluster: engine actors that live for the whole job.

Each worker is one Ray actor, created once: it loads the model once and keeps its prefix cache for
the whole job. The driver reads the rows as a stream, triages them (bad rows, resume) and sends
each to a worker: a prefix group to a worker that already holds its prefix, a new group to the
least-loaded worker. No worker holds more than `capacity` rows unanswered, and the driver waits for
answers before reading on, so memory stays bounded at any file size. Inside an actor a thread runs
the same `answer` loop as a local run over an inbox the driver keeps filling: the next group's rows
enter the engine while the previous group decodes. The driver writes every record; a worker that
dies is replaced and the rows it had not answered are sent again, so nothing is lost or doubled;
one the cluster no longer has room for (a lost node) is given up and its rows go to the others.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from chunkgen.config import Config
from chunkgen.engine.engine import EngineStats
from chunkgen.jobs.formats import RecordFormat
from chunkgen.jobs.groups import group_digest
from chunkgen.jobs.ledger import is_error
from chunkgen.jobs.requests import ErrorRecord, Job
from chunkgen.jobs.run import USAGE, JobCounts, JobSummary, answer, never, summarize, triage
from chunkgen.jobs.writer import ResultWriter

COLLECT_WAIT_S = 1.0  # a worker answers a collect call at the latest this long after it was made
SEND_ROWS = 32  # rows sent to a worker in one call
STOP_CHECK_S = 1.0  # the driver waits for answers this long at a time, then looks at the stop flag again
MAX_REPLACEMENTS = 3  # workers replaced in one job before it stops (the records written are kept)
PLACE_WAIT_S = 10.0  # a worker not placed this long, with no room for it in the cluster, gives its rows away
GROUPS_REMEMBERED = 65536  # prefix groups whose workers the driver remembers (least recently used dropped)
DEFAULT_CPU_WORKERS = 2

Row = tuple[int, Job]  # (index in the input, row)
Answered = tuple[int, dict, tuple[int, ...]]  # (index, record, USAGE counts)


@dataclass(frozen=True)
class WorkerShape:
    """How many engine actors, and what each asks the cluster for."""

    count: int
    num_cpus: float
    num_gpus: int
    threads: int  # torch threads in each actor


def plan_workers(device: str, requested: int | None, cluster: dict[str, float], node_cpus: list[float]) -> WorkerShape:
    """Workers sized from the cluster's resources: on GPUs one per GPU (unless fewer are asked for);
    on CPUs the cluster's cores shared out, no worker asking for more than the largest machine has."""
    cpus = cluster.get("CPU", 0.0)
    if device.startswith("cuda"):
        gpus = int(cluster.get("GPU", 0))
        if gpus < 1:
            raise ValueError("--device cuda: the Ray cluster has no GPUs (`ray status` lists its resources)")
        count = requested or gpus
        if count > gpus:
            raise ValueError(f"--workers {count} with --device cuda needs {count} GPUs; the Ray cluster has {gpus}")
        # The GPU does the work; a CPU share small enough that every GPU's actor fits.
        per = min(1.0, cpus / count) if cpus else 0.0
        return WorkerShape(count, _share(per), 1, 1)
    count = requested or DEFAULT_CPU_WORKERS
    if cpus <= 0:
        raise ValueError("the Ray cluster has no CPUs to run workers on (`ray status` lists its resources)")
    per = min(cpus / count, max(node_cpus, default=cpus))
    per = float(int(per)) if per >= 1 else _share(per)  # whole cores, or a fraction of one
    return WorkerShape(count, per, 0, max(1, int(per)))


def choose_worker(held: list[int], loads: list[int], capacity: int) -> int | None:
    """Where a row of a prefix group goes: the least-loaded of the workers holding its prefix; a new
    group to the least-loaded worker; and when the group's holders are full, another worker that is
    at most half full (one more prefill of the prefix keeps it busy). None: wait for answers."""
    with_room = [w for w in held if loads[w] < capacity]
    if with_room:
        return min(with_room, key=lambda w: (loads[w], w))
    w = min(range(len(loads)), key=lambda i: (loads[i], i))
    return w if loads[w] < (capacity // 2 if held else capacity) else None


def actor_options(shape: WorkerShape) -> dict[str, Any]:
    """What each engine actor asks Ray for. Calls may run side by side: the driver's submit while a
    collect waits for answers."""
    return {"num_cpus": shape.num_cpus, "num_gpus": shape.num_gpus, "max_concurrency": 4}


def _share(cpus: float) -> float:
    return max(0.01, int(cpus * 100) / 100)  # rounded down: the actors must fit the cluster


class EngineWorker:
    """A Ray actor: one model and engine for the whole job, answering the rows it is sent."""

    def __init__(self, config: Config, fmt: str, model_name: str, threads: int) -> None:
        import torch

        from chunkgen.llm import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(config=config)
        self.format = RecordFormat(fmt, model_name)
        self.window = self.llm.config.window
        self.inbox: queue.Queue[Row | None] = queue.Queue()
        self.rows_sent: int | None = None  # set when the driver has sent its last row
        self.outbox: list[Answered] = []
        self.done = threading.Condition()
        self.failure: str | None = None
        self.produced = 0
        self.taken = 0  # rows the engine thread has taken from the inbox
        self.draining = False  # asked to stop: no row is started, the ones in flight finish
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, rows: list[Row]) -> None:
        for row in rows:
            self.inbox.put(row)
        self._keep_running()

    def _keep_running(self) -> None:
        # A lost worker's rows can come after this one's last row was answered: its thread had
        # ended, another one answers them.
        with self.done:
            if not self.thread.is_alive() and self.failure is None and not self.draining:
                self.thread = threading.Thread(target=self._run, daemon=True)
                self.thread.start()

    def finish(self, rows_sent: int) -> None:
        """No more rows after these: the engine thread ends once it has answered `rows_sent` rows.
        (Calls to a threaded actor may run out of order: a submit can still be on its way.)"""
        self.rows_sent = rows_sent
        self.inbox.put(None)  # wakes the engine thread if it waits for rows
        self._keep_running()

    def drain(self) -> None:
        """The run is stopping: no queued row is started; the rows in flight run on to their answers,
        then the engine thread ends (collect says when)."""
        self.draining = True
        self.inbox.put(None)  # wakes the engine thread if it waits for rows

    def collect(self, wait_s: float = COLLECT_WAIT_S) -> tuple[list[Answered], EngineStats, bool]:
        """The records finished since the last call (waiting up to wait_s for one), the engine's
        stats, and whether a drain is over (no row in flight)."""
        with self.done:
            if not self.outbox and self.failure is None:
                self.done.wait(wait_s)
            if self.failure is not None:
                raise RuntimeError(f"the engine failed: {self.failure}")
            out, self.outbox = self.outbox, []
            self._handing(out)
            engine_stats = self.llm.engine.stats  # every step's batch size would be a long list: its peak only
            stats = dataclasses.replace(engine_stats, batch_sizes=[max(engine_stats.batch_sizes, default=0)])
            drained = self.draining and not self.thread.is_alive()
        return out, stats, drained

    def _handing(self, out: list[Answered]) -> None:
        """Called (holding `done`) as a collect hands `out` to the driver; a subclass may watch."""

    def _answered(self) -> None:
        """Called on the engine thread after each answer reaches the outbox; a subclass may watch."""

    def _rows(self):
        """The inbox as `answer`'s source. While it is empty: None (nothing ready yet) when the engine
        has work or rows were just taken, so those get answered; else wait for the driver."""
        engine, fresh = self.llm.engine, False
        while (self.rows_sent is None or self.taken < self.rows_sent) and not self.draining:
            try:
                row = self.inbox.get_nowait() if engine.has_work or fresh else self.inbox.get()
            except queue.Empty:
                fresh = False
                yield None
                continue
            if row is not None:  # None: finish() woke us; the loop's condition decides
                self.taken, fresh = self.taken + 1, True
                yield row

    def _run(self) -> None:
        try:
            draining = lambda: self.draining  # noqa: E731
            rows = self._rows()
            for a in answer(self.llm.engine, self.llm.encode, self.format, rows, self.window, draining, stop_now=never):
                ok = a.result if a.result is not None and a.result.error is None else None
                with self.done:
                    self.outbox.append((a.index, a.record, tuple(getattr(ok, f) if ok else 0 for f in USAGE)))
                    self.produced += 1
                    self.done.notify_all()
                self._answered()
        except BaseException as exc:  # reported to the driver by the next collect
            with self.done:
                self.failure = f"{type(exc).__name__}: {exc}"
                self.done.notify_all()


@dataclass
class _Slot:
    """One worker as the driver sees it: its actor, the rows it has not answered, its latest stats."""

    actor: Any
    unanswered: dict[int, Job] = field(default_factory=dict)  # sent or about to be
    outgoing: list[Row] = field(default_factory=list)
    sent: int = 0  # rows sent to the current actor
    collecting: Any = None  # the pending collect call
    stats: EngineStats | None = None  # None until it has loaded the model and answered a call
    finished: bool = False
    started: float = 0.0  # when its actor was asked for
    gone: bool = False  # retired: the cluster has no room for it, its rows went to the others
    drained: bool = False  # asked to drain, and no row of it is in flight any more

    @property
    def load(self) -> int:
        return len(self.unanswered)


class _Pool:
    """The driver's side: the actors, routing, collecting answers and replacing dead workers."""

    def __init__(
        self, shape: WorkerShape, config: Config, writer: ResultWriter, counts: JobCounts, capacity: int
    ) -> None:
        import ray

        self.ray = ray
        self.actor_class = ray.remote(EngineWorker).options(**actor_options(shape))
        if shape.num_gpus:
            config = dataclasses.replace(config, device="cuda:0")  # each actor sees its own GPU as the first
        self.args = (config, writer.format.fmt, writer.format.model_name, shape.threads)
        self.writer, self.counts, self.capacity = writer, counts, capacity
        self.slots = [_Slot(None) for _ in range(shape.count)]
        for slot in self.slots:
            self._start(slot)
        self.retired: list[EngineStats] = []  # the last stats of workers that died
        self.need = ("GPU", shape.num_gpus) if shape.num_gpus else ("CPU", shape.num_cpus)
        self.replacements = 0
        self.holders: OrderedDict[bytes, list[int]] = OrderedDict()
        self.draining = False

    def _start(self, slot: _Slot) -> None:
        slot.actor = self.actor_class.remote(*self.args)  # loads the model; calls wait for it
        slot.collecting = slot.actor.collect.remote()
        slot.stats, slot.sent, slot.started = None, 0, time.monotonic()

    # -- routing ------------------------------------------------------------------------------
    def route(self, row: Row) -> int | None:
        """The worker for this row (now sent, or queued to be), or None while its workers are full."""
        key = group_digest(row[1])
        held = self.holders.get(key, [])
        w = choose_worker(held, [self.capacity if s.gone else s.load for s in self.slots], self.capacity)
        if w is None:
            return None
        if w not in held:
            self.holders[key] = held + [w]
        self.holders.move_to_end(key)
        if len(self.holders) > GROUPS_REMEMBERED:
            self.holders.popitem(last=False)
        slot = self.slots[w]
        slot.unanswered[row[0]] = row[1]
        slot.outgoing.append(row)
        if len(slot.outgoing) >= SEND_ROWS:
            self._send(slot)
        return w

    def _send(self, slot: _Slot) -> None:
        if slot.outgoing:
            slot.actor.submit.remote(slot.outgoing)
            slot.sent += len(slot.outgoing)
            slot.outgoing = []

    @property
    def live(self) -> list[_Slot]:
        return [s for s in self.slots if not s.gone]

    def finish(self) -> None:
        for slot in self.live:
            self._send(slot)
            slot.actor.finish.remote(slot.sent)
            slot.finished = True

    def drain(self) -> None:
        """The run is stopping: rows not sent yet stay unsent, every worker finishes its rows in
        flight and starts no other."""
        self.draining = True
        for slot in self.live:
            slot.outgoing = []
            slot.actor.drain.remote()

    @property
    def drained(self) -> bool:
        """Every worker that loaded the model has no row in flight (one still loading has none)."""
        return all(s.drained or s.stats is None for s in self.live)

    # -- answers ------------------------------------------------------------------------------
    @property
    def unanswered(self) -> int:
        return sum(s.load for s in self.live)

    def collect(self, timeout: float | None) -> None:
        """Writes the records of every worker that has some (waiting up to `timeout` for one)."""
        if not self.draining:
            self._retire_unplaced()
            for slot in self.live:
                self._send(slot)
        calls = {s.collecting: s for s in self.live}
        ready, _ = self.ray.wait(list(calls), num_returns=1, timeout=timeout)
        if ready:  # take whatever else is ready too
            ready, _ = self.ray.wait(list(calls), num_returns=len(calls), timeout=0)
        for ref in ready:
            slot = calls[ref]
            try:
                answered, slot.stats, slot.drained = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as exc:
                self._replace(slot, exc)
                continue
            for index, record, usage in answered:
                del slot.unanswered[index]
                self.writer.write(record, index)
                if is_error(record):
                    self.counts.failed += 1
                else:
                    self.counts.answered += 1
                    self.counts.add_usage(dict(zip(USAGE, usage)).__getitem__)
            slot.collecting = slot.actor.collect.remote()

    def _replace(self, slot: _Slot, exc: Exception) -> None:
        """A dead worker: a new actor in its place, sent every row the old one had not answered."""
        if getattr(exc, "actor_init_failed", False):  # loading the model raised: another try would too
            raise RuntimeError(f"a Ray worker failed to start: {exc}") from None
        self.ray.kill(slot.actor, no_restart=True)  # an unavailable one may come back: it must not answer
        self.replacements += 1
        if self.replacements > MAX_REPLACEMENTS:
            raise RuntimeError(
                f"{self.replacements} Ray workers died in this job (last: {exc}); the records "
                "written so far are kept, and a rerun with --resume continues from them"
            ) from None
        if slot.stats is not None:
            self.retired.append(slot.stats)
        if self.draining:  # stopping: its rows are left to --resume
            slot.gone, slot.unanswered, slot.outgoing = True, {}, []
            return
        self._start(slot)
        slot.outgoing = list(slot.unanswered.items())  # what was sent, and what was about to be
        self._send(slot)
        if slot.finished:
            slot.actor.finish.remote(slot.sent)

    def _retire_unplaced(self) -> None:
        """A worker that has not started for PLACE_WAIT_S while the cluster's live nodes no longer fit
        every worker (a node was lost: its replacement, or a worker planned before the loss was
        noticed) is given up: the others answer its rows, where waiting for it would wait for ever."""
        now = time.monotonic()
        waiting = [s for s in self.live if s.stats is None and now - s.started > PLACE_WAIT_S]
        if not waiting or len(self.live) < 2:
            return
        resource, amount = self.need
        fits = sum(int(n["Resources"].get(resource, 0.0) / amount + 1e-9) for n in self.ray.nodes() if n.get("Alive"))
        if fits >= len(self.live):
            return  # the cluster has room for it: it is being placed or loading the model
        given_up = waiting[: min(len(self.live) - fits, len(self.live) - 1)]
        rows: list[Row] = []
        for slot in given_up:
            self.ray.kill(slot.actor, no_restart=True)
            slot.gone = True
            rows += slot.unanswered.items()
            slot.unanswered, slot.outgoing = {}, []
        self.holders = OrderedDict((k, [w for w in held if not self.slots[w].gone]) for k, held in self.holders.items())
        live = self.live
        for row in rows:  # over capacity if need be: these rows were already taken in
            heir = min(live, key=lambda s: s.load)
            heir.unanswered[row[0]] = row[1]
            heir.outgoing.append(row)
        for heir in live:
            self._send(heir)
            if heir.finished:
                heir.actor.finish.remote(heir.sent)

    def close(self) -> None:
        for slot in self.slots:
            self.ray.kill(slot.actor)

    def engine_stats(self) -> list[EngineStats]:
        """The stats of every engine that loaded the model, the replaced ones too."""
        return [s.stats for s in self.slots if s.stats is not None] + self.retired


_REAPER: list = []  # the watcher of the local cluster's processes, one per driver process


def _keep_reaper() -> None:
    from chunkgen.scale.reaper import start_reaper

    if not _REAPER:
        _REAPER.append(start_reaper())


def run_on_ray(
    items: Iterable[Job | ErrorRecord],
    writer: ResultWriter,
    config: Config,
    workers: int | None = None,
    address: str | None = None,
    should_stop: Callable[[], bool] = never,
    on_start: Callable[[WorkerShape], None] | None = None,
    stop_now: Callable[[], bool] | None = None,
) -> JobSummary:
    """Run the job on Ray. Bad rows and resume are handled on the driver (`triage`), answers on the
    workers (`answer`), every record written by the driver's writer. Once `should_stop` says so no
    row is sent or started, and the workers' rows in flight run on to their answers until
    `stop_now` (default: should_stop itself: at once)."""
    import ray

    t0 = time.perf_counter()
    if not ray.is_initialized():
        if address is None:  # a local cluster, started by this process: it must not outlive it
            _keep_reaper()
        # ray.init installs its own crash handler for SIGTERM (a stack dump, then death): the
        # caller's handlers (a run's stop-after-this-step) are put back over it.
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        for s, h in handlers.items():
            if h is not None:
                signal.signal(s, h)
    node_cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    shape = plan_workers(config.device, workers, ray.cluster_resources(), node_cpus)
    counts = JobCounts()
    # twice what a worker's engine takes in at once
    capacity = 2 * config.window
    pool: _Pool | None = None  # started at the first row to answer: a finished job loads no model
    try:
        for n, row in enumerate(triage(items, writer, counts)):
            if should_stop():
                break
            if pool is None:
                pool = _Pool(shape, config, writer, counts, capacity)
                if on_start:
                    on_start(shape)
            while pool.route(row) is None and not should_stop():
                pool.collect(timeout=STOP_CHECK_S)  # every worker this row could go to is full
            if n % SEND_ROWS == SEND_ROWS - 1:  # write what is ready as we go
                pool.collect(timeout=0)
        if pool and not should_stop():
            pool.finish()
            while pool.unanswered and not should_stop():
                pool.collect(timeout=STOP_CHECK_S)
        if pool and should_stop():
            pool.drain()
            while not (stop_now or should_stop)() and not pool.drained:
                pool.collect(timeout=STOP_CHECK_S)
    finally:
        if pool:
            pool.close()
    interrupted = should_stop()
    writer.close(complete=not interrupted)  # a finished job drops earlier runs' error records, as locally
    return summarize(
        counts,
        pool.engine_stats() if pool else [],
        len(writer.changed),
        time.perf_counter() - t0,
        interrupted,
        workers=shape.count if pool else 0,
    )
