"""/v1/completions rows of OpenAI batch files: parsed, refused with a reason, answered in OpenAI's
shape (echo with the prompt's logprobs equal to transformers'), and a file of rows for an endpoint
chunkgen does not serve refused before the model loads."""

from __future__ import annotations

import json

import pytest
import torch

from chunkgen.jobs.requests import ErrorRecord, Job, openai_jobs
from tests.helpers import HF_ATTENTION, base_args, records, rows_of, run_cli


def _row(body: dict, cid: str = "r", url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_completions_rows_parsed_and_refused():
    lines = [
        _row({"prompt": "The water", "max_tokens": 0, "echo": True, "logprobs": 3}, "score"),
        _row({"prompt": ["The water"]}, "one"),
        _row({"prompt": [1, 5, 9], "echo": True}, "ids"),
        _row({"prompt": "a", "suffix": "b"}, "suffix"),
        _row({"prompt": ["a", "b"]}, "many"),
        _row({"prompt": "a", "max_tokens": 0}, "zero"),
        _row({"prompt": "a", "logprobs": 21}, "top"),
        _row({"prompt": "", "max_tokens": 2}, "empty"),
        _row({"prompt": "a", "tools": [1]}, "tools"),
        _row({"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "chat0", "/v1/chat/completions"),
    ]
    got = {i.id: i for i in openai_jobs(rows_of(*lines), {})}
    score = got["score"]
    assert isinstance(score, Job) and score.prompt == "The water" and score.echo
    assert score.params.max_new_tokens == 0 and score.params.prompt_logprobs == 3 and score.params.logprobs == 3
    assert got["one"].prompt == "The water" and got["one"].params.max_new_tokens == 16
    assert got["one"].params.prompt_logprobs is None
    assert got["ids"].prompt == [1, 5, 9] and got["ids"].params.prompt_logprobs == 0  # echo needs the texts
    errors = {k: (v.field, v.message) for k, v in got.items() if isinstance(v, ErrorRecord)}
    assert errors["suffix"][0] == "body.suffix" and "\n" not in errors["suffix"][1]
    assert errors["many"] == (
        "body.prompt",
        "holds 2 prompts; give one prompt per row (each row gets its own custom_id)",
    )
    assert errors["zero"][0] == "body.max_tokens"
    assert errors["top"][0] == "body.logprobs"
    assert errors["empty"][0] == "body.prompt"
    assert errors["tools"][0] == "body.tools"
    assert errors["chat0"] == ("body.max_tokens", "must be an integer >= 1, got 0")
    assert got["score"].request_hash != got["one"].request_hash


def _run(tiny_model, queries, out):
    return run_cli(*base_args(tiny_model, out, queries, None, max_new_tokens=None))


def test_completions_echo_logprobs_equal_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shared = "How often are reservoirs inspected? Weekly. What is the chlorine target?"
    lines = [
        _row({"prompt": shared + " Low.", "max_tokens": 0, "echo": True, "logprobs": 2}, "a"),
        _row({"prompt": shared + " High.", "max_tokens": 0, "echo": True, "logprobs": 2}, "b"),
        _row({"prompt": shared, "max_tokens": 3, "logprobs": 1, "echo": True}, "gen"),
    ]
    queries = tmp_path / "q.jsonl"
    queries.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(tiny_model, queries, out).exit_code == 0
    recs = {r["custom_id"]: r["response"]["body"] for r in records(out)}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    for cid, text in (("a", shared + " Low."), ("b", shared + " High.")):
        body = recs[cid]
        assert body["object"] == "text_completion"
        choice = body["choices"][0]
        assert choice["text"] == text and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) <= 1e-4
            assert len(lp["top_logprobs"][p]) <= 2
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    gen = recs["gen"]["choices"][0]
    assert gen["text"].startswith(shared) and len(gen["logprobs"]["tokens"]) == len(tok(shared)["input_ids"]) + 3
    assert all(v is not None for v in gen["logprobs"]["token_logprobs"][1:])


def test_file_for_an_endpoint_not_served_refused_before_load(tmp_path):
    queries = tmp_path / "emb.jsonl"
    queries.write_text("\n".join(_row({"input": "x"}, f"e{i}", "/v1/embeddings") for i in range(3)) + "\n")
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tmp_path / "no-model", out, queries, None))
    assert res.exit_code != 0 and not out.exists()
    line = [l for l in res.output.splitlines() if "/v1/embeddings" in l]
    assert line and "/v1/completions" in line[0], res.output


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_served_endpoints_not_refused_as_a_file(url, tmp_path):
    from chunkgen.jobs.whole_file import check_sample

    queries = tmp_path / "q.jsonl"
    queries.write_text(_row({"prompt": "x"}, "a", url) + "\n" + _row({"input": "x"}, "b", "/v1/embeddings") + "\n")
    check_sample(queries, "openai", None, "custom_id")


# A child that runs `chunkgen run`, stops it with SIGTERM once `stop_at` records are written (or
# lets it finish), and prints its peak RSS.
_STOPPING_RUN = """
import resource, signal, subprocess, sys, time
stop_at, out, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
deadline = time.monotonic() + 240
while p.poll() is None and time.monotonic() < deadline:
    try:
        with open(out, "rb") as f:
            if sum(1 for _ in f) >= stop_at:
                p.send_signal(signal.SIGTERM)
                break
    except FileNotFoundError:
        pass
    time.sleep(0.2)
_, err = p.communicate()
sys.stderr.write(err)
print("RSS", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "RC", p.returncode)
"""


def _score_rows(path, n: int) -> None:
    """n /v1/completions rows that score one token each (BOS, then a token), given as token ids."""
    with open(path, "w") as f:
        for i in range(n):
            body = {"prompt": [1, 3 + i % 250], "max_tokens": 0, "echo": True, "logprobs": 1}
            f.write(json.dumps({"custom_id": f"r{i:06d}", "url": "/v1/completions", "body": body}) + "\n")


def test_a_100k_row_scoring_file_runs_in_bounded_memory(tiny_model, tmp_path):
    """A 100,000-row scoring file is read whole before the first row runs (the prefix order keys
    every row) and then streamed: stopped after 1,500 answers, its peak RSS is that of a
    1,500-row file answered whole."""
    import subprocess
    import sys

    from tests.cli.test_mistakes import _env

    def peak(queries, out, stop_at: int) -> tuple[int, int, str]:
        argv = [sys.executable, "-m", "chunkgen", "run", "-q", str(queries), "-o", str(out), "--quiet"]
        argv += ["--model", str(tiny_model), "--chunk-size", "16", "--kv-memory", "64MiB", "--dtype", "fp32"]
        done = subprocess.run(
            [sys.executable, "-c", _STOPPING_RUN, str(stop_at), str(out), *argv],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        words = done.stdout.split()
        return int(words[words.index("RSS") + 1]) * 1024, int(words[words.index("RC") + 1]), done.stderr

    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    _score_rows(small, 1_500)
    _score_rows(big, 100_000)
    base, rc, err = peak(small, tmp_path / "small.out.jsonl", 10**9)
    assert rc == 0 and len(records(tmp_path / "small.out.jsonl")) == 1_500, err
    rss, rc, err = peak(big, tmp_path / "big.out.jsonl", 1_500)
    assert rc == 143 and "--resume to continue" in err, err  # stopped by SIGTERM, cleanly
    recs = records(tmp_path / "big.out.jsonl")
    assert len(recs) >= 1_500
    body = recs[0]["response"]["body"]["choices"][0]["logprobs"]
    assert body["token_logprobs"][0] is None and isinstance(body["token_logprobs"][1], float)
    assert rss < 1.25 * base, (rss, base)
