"""Ray Data scale-out on a local cluster: same records as a local run, and a worker that dies
mid-job is retried without losing or duplicating records."""
from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from tests.test_cli import PROMPTS, base_args, records, run_cli  # noqa: E402


@pytest.fixture
def local_ray(tmp_path):
    """A local 2-CPU cluster whose workers crash once (the marker file records that they did)."""
    marker = tmp_path / "crashed"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"CHUNKGEN_FAULT_CRASH_ONCE": str(marker)}})
    yield marker
    ray.shutdown()


def mixed_queries(tmp_path):
    queries = tmp_path / "mixed.jsonl"
    rows = []
    for i in range(3):
        rows.append({"id": f"m{i}", "template": "arithmetic_cot", "question": f"What is {i} + 1?"})
        rows.append({"id": f"d{i}", "template": "document_qa", "question": f"Question {i}?"})
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    return queries


def test_ray_run_equals_local_run_and_survives_a_crashed_worker(tiny_model, tmp_path, local_ray, monkeypatch):
    import chunkgen.scale.ray as scale_ray

    monkeypatch.setattr(scale_ray, "WINDOW_ROWS", 4)  # the driver holds 4 rows at a time: two windows
    marker = local_ray
    queries = mixed_queries(tmp_path)
    local = tmp_path / "local.jsonl"
    assert run_cli(*base_args(tiny_model, local, queries=queries, template=PROMPTS)).exit_code == 3
    dist = tmp_path / "ray.jsonl"
    res = run_cli(*base_args(tiny_model, dist, queries=queries, template=PROMPTS), "--ray", "--workers", "2")
    assert res.exit_code == 3, res.output
    assert marker.exists(), "the fault was not injected"
    got, want = records(dist), records(local)
    key = lambda r: r.get("id") or f"line:{r['line']}"  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))  # every record exactly once
    by_id = {key(r): r for r in want}
    for r in got:
        assert r.get("text") == by_id[key(r)].get("text")
    again = run_cli(*base_args(tiny_model, dist, queries=queries, template=PROMPTS), "--ray", "--resume")
    # resume: nothing left to answer; the bad line is reported again (its record replaced, not doubled)
    assert again.exit_code == 3 and "0 answered" in again.output
    assert sorted(map(key, records(dist))) == sorted(map(key, got))
