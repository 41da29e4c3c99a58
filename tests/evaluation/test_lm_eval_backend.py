"""The lm-evaluation-harness backend against lm-eval's own `hf` backend on the shipped offline
tasks (evals/water): each loglikelihood, rolling loglikelihood and answer, and every metric."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the `eval` extra; `make test` installs it

from tests.helpers import ROOT  # noqa: E402

TASKS = ["water_mc", "water_rolling", "water_gen"]


def _tasks_here(tmp_path: Path) -> Path:
    """The shipped task files with the data file's path made absolute (lm-eval reads it from the cwd)."""
    out = tmp_path / "tasks"
    out.mkdir()
    data = ROOT / "evals" / "water" / "water.jsonl"
    for yaml in (ROOT / "evals" / "water").glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("evals/water/water.jsonl", str(data)))
    return out


def _evaluate(model: str, model_args: str, include: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import chunkgen.evaluation.lm_eval_backend  # noqa: F401  # registers "chunkgen"

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        num_fewshot=None,
        batch_size=1,
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path=str(include)),
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def test_metrics_equal_hf_backend(tiny_model, tmp_path):
    include = _tasks_here(tmp_path)
    ours = _evaluate("chunkgen", f"pretrained={tiny_model},dtype=float32,chunk_size=16,kv_memory=64MiB", include)
    theirs = _evaluate("hf", f"pretrained={tiny_model},dtype=float32", include)
    for task in TASKS:
        a, b = ours["results"][task], theirs["results"][task]
        metrics = [k for k in b if "," in k and "stderr" not in k]
        assert metrics
        for k in metrics:
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-3), (task, k)
        for sa, sb in zip(ours["samples"][task], theirs["samples"][task]):
            for ra, rb in zip(sa["resps"], sb["resps"]):
                if isinstance(rb[0], tuple):  # loglikelihood: (logprob, is_greedy)
                    assert ra[0][0] == pytest.approx(rb[0][0], abs=1e-3) and ra[0][1] == rb[0][1]
                elif isinstance(rb[0], float):  # rolling
                    assert ra[0] == pytest.approx(rb[0], abs=1e-3)
                else:  # generated text
                    assert ra == rb


def test_eval_command_runs_lm_eval(tiny_model, tmp_path):
    from tests.helpers import run_cli

    include = _tasks_here(tmp_path)
    res = run_cli(
        "eval", "--model_args", f"pretrained={tiny_model},dtype=fp32,chunk_size=16,kv_memory=64MiB",
        "--tasks", "water_mc", "--include_path", str(include), "--num_fewshot", "2", "--batch_size", "1",
        "--output_path", str(tmp_path / "out"), "--log_samples",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert list((tmp_path / "out").rglob("results_*.json")) and list((tmp_path / "out").rglob("samples_water_mc*"))
