"""One job over a Ray cluster with Ray Data: rows are grouped by prompt prefix (template, or system
messages), each group goes whole to one stateful engine actor, so a shared prefix is prefilled on
one worker only; the driver streams every record into the same output file a local run writes,
with the same error records and resume."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from chunkgen.engine import Request, SamplingParams
from chunkgen.jobs.requests import ErrorRecord, Job
from chunkgen.jobs.results import RecordFormat, ResultWriter, error_key
from chunkgen.scale.shard import prefix_key

CRASH_ONCE_ENV = "CHUNKGEN_FAULT_CRASH_ONCE"  # fault injection for tests: a marker file path


def _encode_job(job: Job) -> str:
    return json.dumps({"id": job.id, "line": job.line, "messages": job.messages,
                       "params": job.params.as_dict(), "template": job.template})


def _decode_job(text: str) -> Job:
    d = json.loads(text)
    return Job(d["id"], d["line"], d["messages"], SamplingParams(**d["params"]), d["template"])


class GroupWorker:
    """A Ray Data actor: one model and engine, kept across the groups it is given (its prefix
    cache too)."""

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
        jobs = {int(i): _decode_job(j) for group in batch["jobs"] for i, j in json.loads(group)}
        out_index, out_record = [], []
        requests = []
        for index, job in jobs.items():
            tokens = self.llm.encode(job.messages)
            if len(tokens) + 1 > self.llm.model.max_context:
                err = ErrorRecord(job.id, job.line, "prompt",
                                  f"prompt is {len(tokens)} tokens; the model's context is {self.llm.model.max_context}")
                out_index.append(index)
                out_record.append(json.dumps(self.format.error_record(err)))
                continue
            requests.append(Request(index, tokens, job.params))
        for res in self.llm.engine.stream(requests):
            out_index.append(res.id)
            out_record.append(json.dumps(self.format.result_record(jobs[res.id], res)))
        return pd.DataFrame({"index": out_index, "record": out_record})


def run_on_ray(items: Iterable[Job | ErrorRecord], writer: ResultWriter, llm_kwargs: dict[str, Any],
               workers: int, cpus_per_worker: float | None = None, address: str | None = None,
               max_group: int = 256) -> dict:
    """Run the job on Ray Data; returns counts. Bad lines and resume are handled on the driver.

    Rows are grouped here, on the driver, into one dataset row per prefix group (split every
    `max_group` queries so one template can still use every worker): no shuffle stage competes
    with the engine actors for CPUs."""
    import ray

    groups: dict[str, list] = {}
    errors, skipped = 0, 0
    for index, item in enumerate(items):
        if isinstance(item, ErrorRecord):
            if error_key(item) in writer.done:
                skipped += 1
                writer.skip(index)
            else:
                errors += 1
                writer.write(writer.error_record(item), index)
        elif item.id in writer.done:
            skipped += 1
            writer.skip(index)
        else:
            groups.setdefault(prefix_key(item), []).append([index, _encode_job(item)])
    rows = [{"key": key, "jobs": json.dumps(members[i : i + max_group])}
            for key, members in groups.items() for i in range(0, len(members), max_group)]
    written = 0
    if rows:
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
        # Fractional CPUs: whole ones for every actor would leave none for Ray Data's own tasks.
        cpus = cpus_per_worker or max(0.25, min(1.0, ray.cluster_resources().get("CPU", 1) / (workers + 1)))
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
        results = ds.map_batches(
            GroupWorker, fn_constructor_args=(llm_kwargs, writer.fmt, writer.model_name),
            batch_size=1, batch_format="pandas", compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=cpus,
        )
        for row in results.iter_rows():
            record = json.loads(row["record"])
            writer.write(record, int(row["index"]))
            written += 1
            errors += "error" in record and record.get("error") is not None
    writer.close()
    return {"records": written, "errors": errors, "skipped": skipped}
