"""How many OpenMP threads a CPU step runs on: those configured, less the cores other processes
keep busy.

A decode step runs hundreds of short parallel regions, and each ends at a barrier. When another
process holds a core, the thread that lands beside it finishes its share a time slice late and the
whole team waits for it: on 2 cores beside one busy process a 32-row step takes 71-74 ms on two
threads and 58-59 ms on one. Alone, the same step is 1.6x faster on two
(benchmarks/results/2026-12-03-xeon-openmp-spin.md). So between steps, about twice a second, the
governor reads how busy this process's CPUs were (/proc/stat) less this process's own CPU time,
and runs on the cores left. Knowing that threads never outnumber free cores, `import chunkgen`
lets them spin longer before they sleep (chunkgen/__init__.py), which is faster alone.

CHUNKGEN_THREADS=fixed keeps torch's thread count as it is. A thread count set with
torch.set_num_threads (or OMP_NUM_THREADS) is the most the governor uses.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

SAMPLE_INTERVAL_S = 0.5
# A thread is given up when other processes' load takes more than this share of the core it would
# run on, and taken back (after two samples in a row) when less than TAKE_BACK_BELOW: a margin so
# that a load near the line does not flip the count on every sample.
GIVE_UP_AT = 0.5
TAKE_BACK_BELOW = 0.3


def adaptive() -> bool:
    """Whether the thread count follows the machine's load (CHUNKGEN_THREADS, default adaptive)."""
    value = os.environ.get("CHUNKGEN_THREADS", "adaptive").strip().lower()
    if value not in ("adaptive", "fixed"):
        raise ValueError(f"CHUNKGEN_THREADS={value!r}: expected 'adaptive' or 'fixed'")
    return value == "adaptive"


@dataclass(frozen=True)
class Sample:
    wall_s: float
    busy_s: float  # CPU time spent on the watched CPUs by everyone, this process included
    own_s: float  # this process's CPU time


def read_busy_seconds(cpus: frozenset[int], path: str = "/proc/stat") -> float:
    """Seconds the given CPUs spent running anything (user, nice, system, irq, softirq) since boot;
    steal, idle and I/O wait are not running."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    with open(path) as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
                total += user + nice + system + irq + softirq
    return total / tick


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Sets torch's thread count, from the thread that runs the steps (OpenMP's thread count is that
    thread's own setting), to the configured count less the cores other processes use."""

    def __init__(
        self,
        cpus: frozenset[int] | None = None,
        busy: Callable[[frozenset[int]], float] = read_busy_seconds,
        own: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._busy, self._own, self._clock = busy, own, clock
        self.interval_s = interval_s
        self.ceiling = self.current = torch.get_num_threads()
        self.others = 0.0  # other processes' load at the last sample, in cores
        self._raise_votes = 0
        self._last = self._sample()

    def _sample(self) -> Sample:
        return Sample(self._clock(), self._busy(self.cpus), self._own())

    def steer(self) -> int:
        """The thread count for the next step: resampled when the last sample is old enough."""
        self.follow_outside()
        now = self._clock()
        if now - self._last.wall_s < self.interval_s:
            return self.current
        sample = self._sample()
        wall = sample.wall_s - self._last.wall_s
        others = (sample.busy_s - self._last.busy_s - (sample.own_s - self._last.own_s)) / wall
        self._last, self.others = sample, max(0.0, others)
        want = self._wanted()
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        return self.current

    def follow_outside(self) -> None:
        """A count someone else set (torch.set_num_threads) is the new most."""
        outside = torch.get_num_threads()
        if outside != self.current:
            self.ceiling = self.current = outside
            self._raise_votes = 0

    def _wanted(self) -> int:
        free = len(self.cpus) - self.others
        if self.current > 1 and free < self.current - 1 + (1 - GIVE_UP_AT):
            self._raise_votes = 0
            return max(1, min(self.ceiling, int(free + GIVE_UP_AT)))
        if self.current < self.ceiling and free > self.current + (1 - TAKE_BACK_BELOW):
            self._raise_votes += 1
            if self._raise_votes >= 2:
                self._raise_votes = 0
                return min(self.ceiling, int(free + TAKE_BACK_BELOW))
            return self.current
        self._raise_votes = 0
        return self.current


_local = threading.local()


def steer_threads() -> int:
    """Before a CPU step: the calling thread's governor steers its thread count (when adaptive and
    /proc/stat can be read); returns the count the step runs on."""
    governor = getattr(_local, "governor", None)
    if governor is None:
        governor = False
        if adaptive():  # also at one thread: a later torch.set_num_threads raises its most
            try:
                governor = ThreadGovernor()
            except (OSError, ValueError):  # no /proc/stat (not Linux), or one this parser cannot read
                pass
        _local.governor = governor
    return governor.steer() if governor else torch.get_num_threads()


def configured_threads() -> int:
    """The threads a step of this thread's engine runs on when no other process is busy: what to
    give another engine benchmarked beside chunkgen, whatever the load took away meanwhile."""
    governor = getattr(_local, "governor", None)
    if not governor:
        return torch.get_num_threads()
    governor.follow_outside()
    return governor.ceiling
