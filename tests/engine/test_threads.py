"""The thread governor: torch's thread count follows the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from chunkgen.engine import threads
from chunkgen.engine.threads import ThreadGovernor, read_busy_seconds


class FakeMachine:
    """A clock, the watched CPUs' busy seconds and this process's CPU seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def governor(self, cpus: int, threads: int) -> ThreadGovernor:
        torch.set_num_threads(threads)
        return ThreadGovernor(
            frozenset(range(cpus)), busy=lambda _: self.busy, own=lambda: self.own, clock=lambda: self.now
        )


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_thread_count_gives_way_to_a_busy_process_and_comes_back_when_it_ends(threads_restored, monkeypatch):
    machine = FakeMachine()
    governor = machine.governor(cpus=2, threads=2)
    machine.run(1.0, own_cores=2.0, other_cores=0.0)
    assert governor.steer() == 2
    machine.run(1.0, own_cores=1.33, other_cores=0.67)  # three busy threads on two cores
    assert governor.steer() == 1 and torch.get_num_threads() == 1
    machine.run(1.0, own_cores=1.0, other_cores=1.0)
    assert governor.steer() == 1
    monkeypatch.setattr(threads._local, "governor", governor, raising=False)
    assert threads.configured_threads() == 2  # what another engine benchmarked beside it gets
    machine.run(1.0, own_cores=1.0, other_cores=0.0)  # it ended: taken back after two samples
    assert governor.steer() == 1
    machine.run(1.0, own_cores=1.0, other_cores=0.0)
    assert governor.steer() == 2 and torch.get_num_threads() == 2


def test_a_light_load_keeps_every_thread_and_a_load_near_the_line_does_not_flip_it(threads_restored):
    machine = FakeMachine()
    governor = machine.governor(cpus=2, threads=2)
    for load in (0.2, 0.45, 0.1):
        machine.run(1.0, own_cores=1.8, other_cores=load)
        assert governor.steer() == 2
    machine.run(1.0, own_cores=1.0, other_cores=0.8)
    assert governor.steer() == 1
    for load in (0.45, 0.35, 0.45, 0.35):  # between the two lines: stays where it is
        machine.run(1.0, own_cores=1.0, other_cores=load)
        assert governor.steer() == 1


def test_on_many_cores_only_the_busy_ones_are_given_up(threads_restored):
    machine = FakeMachine()
    governor = machine.governor(cpus=8, threads=8)
    machine.run(1.0, own_cores=5.0, other_cores=3.0)
    assert governor.steer() == 5
    governor = machine.governor(cpus=16, threads=8)  # threads fewer than the CPUs: a load that leaves 8 free costs none
    machine.run(1.0, own_cores=8.0, other_cores=7.8)
    assert governor.steer() == 8
    machine.run(1.0, own_cores=8.0, other_cores=20.0)  # more than the CPUs can hold: one thread is left
    assert governor.steer() == 1


def test_samples_no_more_often_than_its_interval(threads_restored):
    machine = FakeMachine()
    governor = machine.governor(cpus=2, threads=2)
    machine.run(0.1, own_cores=1.0, other_cores=1.0)
    assert governor.steer() == 2  # too soon after the first sample to judge
    machine.run(0.5, own_cores=1.0, other_cores=1.0)
    assert governor.steer() == 1


def test_a_count_set_from_outside_is_the_new_most(threads_restored):
    machine = FakeMachine()
    governor = machine.governor(cpus=2, threads=2)
    torch.set_num_threads(1)
    machine.run(1.0, own_cores=1.0, other_cores=0.0)
    assert governor.steer() == 1 and governor.ceiling == 1
    machine.run(1.0, own_cores=1.0, other_cores=0.0)
    assert governor.steer() == 1  # a quiet machine does not raise it past what was set
    torch.set_num_threads(2)
    machine.run(1.0, own_cores=2.0, other_cores=0.0)
    assert governor.steer() == 2 and governor.ceiling == 2


def test_busy_seconds_are_read_for_the_watched_cpus_only(tmp_path):
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    stat.write_text(
        "cpu  900 0 900 5000 0 0 0 0 0 0\n"
        "cpu0 100 10 20 5000 7 1 2 300 0 0\n"
        "cpu1 400 0 100 5000 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    assert read_busy_seconds(frozenset({0}), str(stat)) == pytest.approx(133 / hz)  # no idle, iowait or steal
    assert read_busy_seconds(frozenset({0, 1}), str(stat)) == pytest.approx(633 / hz)


def test_fixed_threads_leave_the_count_alone(monkeypatch, threads_restored):
    monkeypatch.setenv("CHUNKGEN_THREADS", "fixed")
    monkeypatch.setattr(threads, "_local", threads.threading.local())
    torch.set_num_threads(2)
    assert threads.steer_threads() == 2 and threads._local.governor is False
    monkeypatch.setenv("CHUNKGEN_THREADS", "sometimes")
    monkeypatch.setattr(threads, "_local", threads.threading.local())
    with pytest.raises(ValueError, match="CHUNKGEN_THREADS='sometimes'"):
        threads.steer_threads()


def test_a_thread_that_starts_on_one_thread_follows_a_count_raised_later(monkeypatch, threads_restored):
    monkeypatch.setenv("CHUNKGEN_THREADS", "adaptive")
    monkeypatch.setattr(threads, "_local", threads.threading.local())
    torch.set_num_threads(1)
    assert threads.steer_threads() == 1 and threads._local.governor
    torch.set_num_threads(2)
    assert threads.steer_threads() == 2 and threads.configured_threads() == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_real_busy_process_takes_a_thread_away(threads_restored):
    cpus = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cpus))
    # One busy process per CPU but the first, all pinned there: the governor watches them all.
    busy = [
        subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile 1: pass"])
        for cpu in cpus[1:]
    ]
    try:
        time.sleep(0.3)
        governor = ThreadGovernor(interval_s=0.3)
        deadline = time.monotonic() + 5.0
        while governor.steer() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert governor.current == 1, f"others' load {governor.others:.2f} cores"
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_every_cpu_engine_step_steers_the_threads_first(tiny_llm, monkeypatch):
    from chunkgen.engine import engine as engine_module
    from chunkgen.engine.params import SamplingParams
    from chunkgen.engine.sequence import Request

    engine = tiny_llm.new_engine()
    steered: list[int] = []
    monkeypatch.setattr(engine_module, "steer_threads", lambda: steered.append(engine.stats.decode_steps) or 1)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    list(engine.stream([Request(i, [10 + i] * 9, params) for i in range(3)]))
    assert steered == [0, 0, 1]  # the prefill wave, then two decode steps, each before it runs
