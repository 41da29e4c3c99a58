"""`chunkgen bench score`: the MMLU-shaped workload's scores through chunkgen equal lm-evaluation-
harness's hf backend on the same token ids, and chunkgen computes each prefix and question once
and one answer per question (the question's last position scores all four letters)."""

from __future__ import annotations

import json

from chunkgen.bench.score import ScoreWorkload, max_difference, run_backend
from tests.helpers import run_cli


def test_workload_shape():
    work = ScoreWorkload(subjects=2, questions=3, choices=4, prefix_tokens=50, question_tokens=7)
    jobs = work.jobs(vocab=1000, bos=1)
    assert len(jobs) == 6 and all(len(j.continuations) == 4 and len(j.context) == 57 for j in jobs)
    assert jobs[0].context[:50] == jobs[2].context[:50] != jobs[3].context[:50]  # a prefix per subject
    assert all(len({c[0] for c in j.continuations}) == 4 for j in jobs)
    assert work.minimum_tokens == 2 * (50 + 3 * (7 + 4))


def test_chunkgen_equals_lm_eval_hf(tiny_model):
    work = ScoreWorkload(subjects=2, questions=3, prefix_tokens=128, question_tokens=9)  # whole 64-token chunks
    ours = run_backend("chunkgen", str(tiny_model), "fp32", work)
    theirs = run_backend("hf", str(tiny_model), "fp32", work, batch_size=4)
    assert sorted(ours["scores"]) == sorted(theirs["scores"])
    assert max_difference(ours["scores"], theirs["scores"]) <= 1e-4
    # every prefix and question once (a question may share its first tokens with another's in the
    # tree), and at most one answer a question
    needed = work.subjects * (work.prefix_tokens + work.questions * work.question_tokens)
    assert (
        needed - work.subjects * work.questions <= ours["prefilled_tokens"] <= needed + work.subjects * work.questions
    )
    assert theirs["prefilled_tokens"] >= work.subjects * work.questions * (work.prefix_tokens + work.question_tokens)


def test_bench_score_command(tiny_model, tmp_path):
    out = tmp_path / "score.json"
    res = run_cli(
        "bench", "score", "--model", str(tiny_model), "--dtype", "fp32", "--subjects", "1", "--questions", "2",
        "--prefix-tokens", "30", "--question-tokens", "5", "--backends", "chunkgen", "--json", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    figures = json.loads(out.read_text())["chunkgen"]
    assert figures["minimum_tokens"] == 30 + 2 * (5 + 4) and figures["peak_rss_bytes"] > 0
    assert run_cli("bench", "score", "--backends", "vllm,nope").exit_code != 0


def test_vllm_backend_without_its_venv_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CHUNKGEN_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    res = run_cli("bench", "score", "--backends", "chunkgen,vllm")
    assert res.exit_code != 0 and "CHUNKGEN_VLLM_PYTHON" in res.output and "absent" in res.output
