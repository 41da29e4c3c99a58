"""A Ray engine worker that dies like a killed machine, once per job: the fault the Ray tests
inject. Pickled by value, so the actor processes get it with the crash plan set on the class."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from ray import cloudpickle

from chunkgen.scale.ray import EngineWorker

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class CrashOnceWorker(EngineWorker):
    """After handing back `crash_after[0]` records, the worker answers nothing more, and on the
    collect after those it dies (`os._exit`), writing the input indexes the driver already has from
    it to `crash_after[1]`. The file also marks the fault taken: a replacement carries on normally."""

    crash_after: tuple[int, Path] | None = None  # set by the test before the job starts

    def __init__(self, *args, **kwargs) -> None:
        planned = type(self).crash_after
        self.crash_after = None if planned is None or planned[1].exists() else planned
        self.handed: list[int] = []
        self.resume = threading.Event()
        super().__init__(*args, **kwargs)

    def _handing(self, out) -> None:
        if self.crash_after and self.produced >= self.crash_after[0] and not out:
            self._crash()
        if self.crash_after:
            self.handed += [i for i, _, _ in out]

    def _answered(self) -> None:
        if self.crash_after and self.produced >= self.crash_after[0]:
            self.resume.wait()  # answer nothing more; the next collect dies

    def _crash(self) -> None:
        path = self.crash_after[1]
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another worker took the fault: this one carries on
            self.crash_after = None
            self.resume.set()
            return
        path.write_text(json.dumps(self.handed))
        os._exit(1)
