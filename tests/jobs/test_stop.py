"""StopFlag: a second signal stops at once; where its KeyboardInterrupt lands in a finaliser and is
swallowed, it is not reported as an error ("Exception ignored ... Traceback") and the grace timer
still ends the run; anything else unraisable is reported as before."""

from __future__ import annotations

import contextlib
import gc
import signal
import sys

from chunkgen.jobs.stop import StopFlag


@contextlib.contextmanager
def _armed_flag():
    """A StopFlag over a recording unraisable hook (what would have printed "Exception ignored"),
    the process's signal handlers and hook put back after."""
    seen = []
    old_hook = sys.unraisablehook
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    sys.unraisablehook = seen.append
    flag = StopFlag()
    try:
        yield flag, seen
    finally:
        flag.restore()  # cancels the timer, puts the recording hook back
        assert sys.unraisablehook == seen.append
        for s, handler in before.items():
            signal.signal(s, handler)
        sys.unraisablehook = old_hook


def test_a_second_signal_swallowed_by_a_finaliser_is_not_reported():
    with _armed_flag() as (flag, seen):
        flag._handle(signal.SIGINT, None)  # the first: noted, the run stops after its step
        assert flag()

        class Finalised:
            def __del__(self):
                flag._handle(signal.SIGINT, None)  # the second, landing inside a finaliser

        Finalised()
        gc.collect()
        assert seen == []
        assert flag._timer is not None and flag._timer.is_alive()  # the run is still stopped at once
    flag._timer.join(5)
    assert not flag._timer.is_alive()


def test_other_unraisable_errors_still_reach_the_previous_hook():
    with _armed_flag() as (flag, seen):
        flag._handle(signal.SIGINT, None)

        class Broken:
            def __del__(self):
                raise ValueError("not ours")

        Broken()
        gc.collect()
        assert [u.exc_type for u in seen] == [ValueError]


def test_the_first_signal_is_told_as_a_line_or_a_json_event(capfd):
    import json

    for announce in ("line", "json", "none"):
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        flag = StopFlag(grace_s=5, announce=announce)
        try:
            flag._handle(signal.SIGTERM, None)
            assert flag() and not flag.overdue()  # asked to stop; the rows in flight have 5 s
        finally:
            flag.restore()
            for s, handler in before.items():
                signal.signal(s, handler)
        err = capfd.readouterr().err
        if announce == "line":
            assert "SIGTERM: taking no new rows; the rows in flight finish within 5 s" in err
        elif announce == "json":
            assert json.loads(err) == {"event": "stopping", "signal": "SIGTERM", "grace_s": 5}
        else:
            assert err == ""
