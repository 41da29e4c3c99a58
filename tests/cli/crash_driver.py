"""Kills `--resume` runs with SIGKILL at random moments, the way a crash or an OOM killer would, then
resumes to the end; run by tests/cli/test_crash.py in a process of its own.

The model loads once; every run is a forked child that continues the same output file and dies by
SIGKILL: after a random delay, before or after a random record, or at a chosen point of the end-of-run rewrite (after k records of the
copy, just before the rename, just after it). Torch runs single-threaded so that forking is safe.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from chunkgen.jobs import writer as results  # noqa: E402  (the module whose read_records the rewrite calls)
from chunkgen.jobs.requests import read_rows, template_jobs  # noqa: E402
from chunkgen.jobs.run import run_job  # noqa: E402
from chunkgen.jobs.templates import load_templates  # noqa: E402
from chunkgen.jobs.writer import ResultWriter  # noqa: E402
from chunkgen.llm import LLM  # noqa: E402


def run(llm: LLM, queries: Path, template: Path, out: Path, max_batch: int) -> None:
    items = template_jobs(read_rows(queries.open("rb")), load_templates(template), {"max_new_tokens": 6})
    writer = ResultWriter(out, "template", "tiny", resume=True)
    run_job(llm.new_engine(max_batch=max_batch), llm.encode, items, writer, window=32)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kind: str, rng: random.Random, max_delay: float) -> None:
    """In the child: make it die at one point."""
    if kind == "timer":
        threading.Timer(rng.uniform(0.0, max_delay), die).start()
    elif kind == "mid-job":  # before or after the k-th record this run writes
        k, before = rng.randint(1, 40), rng.random() < 0.5
        real_emit = ResultWriter._emit
        written = [0]

        def emit(self, line, record):
            written[0] += 1
            if before and written[0] == k:
                die()
            real_emit(self, line, record)
            if written[0] == k:
                die()

        ResultWriter._emit = emit
    elif kind == "mid-copy":
        after = rng.randint(0, 40)
        real_rewrite, real_records = ResultWriter._rewrite, results.read_records

        def counting(path):
            for i, item in enumerate(real_records(path)):
                if i == after:
                    die()
                yield item

        def rewrite(self, first_new):
            results.read_records = counting
            real_rewrite(self, first_new)

        ResultWriter._rewrite = rewrite
    elif kind in ("before-rename", "after-rename"):
        real_replace = os.replace

        def replace(src, dst):
            if kind == "before-rename":
                die()
            real_replace(src, dst)
            die()

        results.os.replace = replace


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("model", "queries", "template", "out", "reference"):
        ap.add_argument(f"--{name}", type=Path, required=True)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # on the CPU: a forked child cannot use a GPU its parent initialised
    llm = LLM(
        model=str(args.model), dtype="fp32", device="cpu", chunk_size=16, kv_memory="64MiB", max_batch=args.max_batch
    )
    run(llm, args.queries, args.template, args.reference, args.max_batch)  # uninterrupted, for comparison

    kinds = ["timer", "mid-job", "mid-job", "mid-copy", "before-rename", "after-rename"]
    log = []
    attempts = 0
    while sum(e["killed"] for e in log) < args.kills and attempts < 10 * args.kills:
        attempts += 1
        # The job itself is cut many times first, then any point, the rewrite included.
        # (by record count first: a timer can outlast the whole job on a fast machine)
        kind = "mid-job" if attempts <= args.kills // 2 else rng.choice(kinds)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                arm(kind, rng, max_delay=2.0)
                run(llm, args.queries, args.template, args.out, args.max_batch)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and os.WEXITSTATUS(status) != 0:
            raise SystemExit(f"a run failed (exit {os.WEXITSTATUS(status)}) after {log}")
        leftovers = [p.name for p in args.out.parent.iterdir() if ".compact-" in p.name]
        lines = len(args.out.read_text().splitlines()) if args.out.exists() else 0
        log.append({"kind": kind, "killed": killed, "leftover_copy": bool(leftovers), "lines": lines})
    run(llm, args.queries, args.template, args.out, args.max_batch)  # --resume to the end
    print(json.dumps(log))


if __name__ == "__main__":
    main()
