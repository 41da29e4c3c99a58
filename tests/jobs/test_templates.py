"""One template reader for the command line and Python: `Template.from_file` builds the prompts
`chunkgen run --template` builds, token for token."""

from __future__ import annotations

import json

from chunkgen.jobs.requests import read_rows, template_jobs
from chunkgen.jobs.templates import Template, load_templates
from chunkgen.llm import LLM


def test_python_and_the_command_line_build_the_same_prompt(tiny_model, tmp_path):
    template = tmp_path / "review.toml"
    template.write_text(
        'name = "review"\nsystem = """\n  Label the review.  \n\n"""\nuser = "Review: {review}"\n'
        "[sampling]\nmax_new_tokens = 5\n"
    )
    rows = [{"id": f"r{i}", "review": text} for i, text in enumerate(["great { }", "bad\n", "  spaced  "])]
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    llm = LLM(str(tiny_model), device="cpu", kv_memory="64MiB")
    with queries.open("rb") as f:  # the command line's path: rows read as `run` reads them
        jobs = list(template_jobs(read_rows(f), load_templates(template), {}))
    t = Template.from_file(template)
    for job, row in zip(jobs, rows):
        assert llm.encode(job.messages, job.data, job.layout) == llm.encode(t.messages(row))
        assert job.params == t.params()
    assert t.system == "Label the review."  # stripped, as the command line strips it
