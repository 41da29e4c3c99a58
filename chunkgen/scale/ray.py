"""One job over a Ray cluster with Ray Data: rows are grouped by prompt prefix (template, or system
messages), each group goes whole to one stateful engine actor, so a shared prefix is prefilled on
one worker only; the driver streams every record into the same output file a local run writes,
with the same error records and resume."""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from chunkgen.engine import SamplingParams
from chunkgen.jobs.requests import ErrorRecord, Job
from chunkgen.jobs.results import RecordFormat, ResultWriter, is_error
from chunkgen.jobs.run import USAGE, JobCounts, JobSummary, answer, never, triage
from chunkgen.scale.shard import prefix_key

CRASH_ONCE_ENV = "CHUNKGEN_FAULT_CRASH_ONCE"  # fault injection for tests: a marker file path


def _encode_job(job: Job) -> str:
    return json.dumps({"id": job.id, "line": job.line, "messages": job.messages, "data": job.data,
                       "params": job.params.as_dict(), "template": job.template})


def _decode_job(text: str) -> Job:
    d = json.loads(text)
    return Job(d["id"], d["line"], d["messages"], SamplingParams(**d["params"]), d["template"], tuple(d["data"]))


class GroupWorker:
    """A Ray Data actor: one model and engine, kept across the groups it is given (its prefix
    cache too). It runs the same `answer` loop as a local run."""

    def __init__(self, llm_kwargs: dict[str, Any], fmt: str, model_name: str) -> None:
        from chunkgen.llm import LLM

        self.llm = LLM(**llm_kwargs)
        self.format = RecordFormat(fmt, model_name)

    def __call__(self, batch):
        import pandas as pd

        marker = os.environ.get(CRASH_ONCE_ENV)
        if marker and not Path(marker).exists():
            Path(marker).write_text("crashed")
            os._exit(1)  # die like a killed worker; Ray must retry this group elsewhere
        jobs = [(int(i), _decode_job(j)) for group in batch["jobs"] for i, j in json.loads(group)]
        answers = list(answer(self.llm.engine, self.llm.encode, self.format, jobs))
        ok = [a.result if a.result is not None and a.result.error is None else None for a in answers]
        return pd.DataFrame({"index": [a.index for a in answers],
                             "record": [json.dumps(a.record) for a in answers],
                             **{f: [getattr(r, f) if r else 0 for r in ok] for f in USAGE}})


# Rows grouped and sent to the cluster at a time: the driver holds one window, never the file. Each
# window is one Ray Data run, so its workers load the model once per window: large enough that
# the loads are a small share of the window's work.
WINDOW_ROWS = 16384


def run_on_ray(items: Iterable[Job | ErrorRecord], writer: ResultWriter, llm_kwargs: dict[str, Any],
               workers: int, cpus_per_worker: float | None = None, address: str | None = None,
               max_group: int = 256, should_stop: Callable[[], bool] = never) -> JobSummary:
    """Run the job on Ray Data. Bad rows and resume are handled on the driver (`triage`), answers on
    the workers (`answer`), every record written by the driver's writer.

    Rows are grouped here, on the driver, a window at a time into one dataset row per prefix group
    (split every `max_group` queries so one template can still use every worker): no shuffle stage
    competes with the engine actors for CPUs."""
    t0 = time.perf_counter()
    counts = JobCounts()
    pending = triage(items, writer, counts)
    while not should_stop():
        window = list(itertools.islice(pending, WINDOW_ROWS))
        if not window:
            break
        _run_window(window, writer, llm_kwargs, workers, cpus_per_worker, address, max_group, should_stop, counts)
    writer.close()
    wall = time.perf_counter() - t0
    return JobSummary(requests=counts.answered, skipped=counts.skipped, errors=counts.failed,
                      changed=len(writer.changed), prompt_tokens=counts.prompt_tokens, cached_tokens=counts.cached_tokens,
                      completion_tokens=counts.completion_tokens, wall_s=wall, prefill_s=0.0, decode_s=0.0,
                      kv_peak_bytes=0, kv_unshared_peak_bytes=0, constrained=counts.constrained,
                      matched=counts.matched, interrupted=should_stop())


def _run_window(window: list[tuple[int, Job]], writer: ResultWriter, llm_kwargs: dict[str, Any], workers: int,
                cpus_per_worker: float | None, address: str | None, max_group: int,
                should_stop: Callable[[], bool], counts: JobCounts) -> None:
    import ray

    groups: dict[str, list] = {}
    for index, job in window:
        groups.setdefault(prefix_key(job), []).append([index, _encode_job(job)])
    rows = [{"key": key, "jobs": json.dumps(members[i : i + max_group])}
            for key, members in groups.items() for i in range(0, len(members), max_group)]
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    # Fractional CPUs: whole ones for every actor would leave none for Ray Data's own tasks.
    cpus = cpus_per_worker or max(0.25, min(1.0, ray.cluster_resources().get("CPU", 1) / (workers + 1)))
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    results = ds.map_batches(
        GroupWorker, fn_constructor_args=(llm_kwargs, writer.fmt, writer.model_name),
        batch_size=1, batch_format="pandas", compute=ray.data.ActorPoolStrategy(size=min(workers, len(rows))),
        num_cpus=cpus,
    )
    for row in results.iter_rows():
        record = json.loads(row["record"])
        writer.write(record, int(row["index"]))
        if is_error(record):
            counts.failed += 1
        else:
            counts.answered += 1
            counts.add_usage(row.__getitem__)
        if should_stop():
            return
