"""Peak resident memory of a model's run, from process start: after the load, and after a job of
ROWS prompts that share SHARED random tokens (each with 32 of its own), greedy, NEW tokens each,
every token generated (no stop). `--wave` runs one prompt of SHARED + 32 tokens for one new token
instead: the first prefill wave's peak. Prints one JSON line: RSS and peak (VmHWM) in GiB after
each part, the K/V the job wrote and the file's size.

    python benchmarks/peak_rss.py MODEL.gguf [--shared 2048] [--rows 32] [--new 64] [--wave]

A random GGUF of a 7-8B shape is what `chunkgen bench e2e --dummy-weights llama-2-7b --quantize
q4_k --systems chunkgen,llama_cpp` writes (its path is in that command's output).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def _status() -> dict[str, float]:
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = round(int(value.split()[0]) / 2**20, 3)
    return {"rss_gib": found["VmRSS"], "peak_gib": found["VmHWM"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--shared", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--wave", action="store_true")
    args = ap.parse_args()

    from chunkgen.engine import SamplingParams
    from chunkgen.llm import LLM

    report: dict = {"model": args.model, "file_gib": round(os.path.getsize(args.model) / 2**30, 3)}
    t = time.perf_counter()
    llm = LLM(model=args.model)
    report["load_s"] = round(time.perf_counter() - t, 1)
    report["after_load"] = _status()
    rnd = random.Random(0)
    shared = [rnd.randrange(100, 30000) for _ in range(args.shared)]
    rows, new = (1, 1) if args.wave else (args.rows, args.new)
    prompts = [shared + [rnd.randrange(100, 30000) for _ in range(32)] for _ in range(rows)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True), progress=False)
    report["job_s"] = round(time.perf_counter() - t, 1)
    report["after_job"] = _status()
    report["kv_written_gib"] = round(llm.engine.pool.peak_bytes / 2**30, 3)
    peak = report["after_job"]["peak_gib"]
    report["peak_less_kv_over_file"] = round((peak - report["kv_written_gib"]) / report["file_gib"], 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
