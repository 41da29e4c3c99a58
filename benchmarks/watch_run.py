"""Run a command for a while and watch it: resident memory (VmRSS from /proc, every second), records
written to its output file, load average; then stop it with SIGTERM (a `chunkgen run` writes its
summary and how to --resume). Prints the first answer's time, answers, rows/s after the first
answer and the peak RSS (the sampled peak and the kernel's high-water mark, VmHWM, read before
the stop). Linux only.

    python benchmarks/watch_run.py --seconds 300 --out out.jsonl --csv samples.csv -- \
        chunkgen run -t prompts/tool_dispatcher.toml -q rows.jsonl -o out.jsonl --max-new-tokens 1
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in bytes (empty once the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class LineCounter:
    """Lines of a file that grows, read incrementally."""

    def __init__(self, path: str) -> None:
        self.path, self.lines, self._f = path, 0, None

    def count(self) -> int:
        if self._f is None:
            try:
                self._f = open(self.path, "rb")
            except OSError:
                return 0
        while chunk := self._f.read(1 << 20):
            self.lines += chunk.count(b"\n")
        return self.lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="stop the command after this long")
    ap.add_argument("--out", required=True, help="the command's output file (records are counted there)")
    ap.add_argument("--csv", help="write every sample here: seconds, rss bytes, records, load average")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if os.path.exists(args.out):
        sys.exit(f"{args.out} exists: remove it first (records are counted there)")
    counter = LineCounter(args.out)
    samples: list[tuple[float, int, int, float]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    first = None
    hwm = 0
    try:
        while proc.poll() is None:
            now = time.monotonic() - t0
            if now >= args.seconds:
                break
            st = _status(proc.pid)
            n = counter.count()
            if n and first is None:
                first = now
            hwm = max(hwm, st.get("VmHWM", 0))
            samples.append((now, st.get("VmRSS", 0), n, os.getloadavg()[0]))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - now)))
        stopped_at = time.monotonic() - t0
        answers = counter.count()
        if proc.poll() is None:
            hwm = max(hwm, _status(proc.pid).get("VmHWM", 0))
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    except BaseException:
        proc.kill()
        raise
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("seconds,rss_bytes,records,load1\n")
            f.writelines(f"{t:.1f},{rss},{n},{load:.2f}\n" for t, rss, n, load in samples)
    gib = 2**30
    peak = max((rss for _, rss, _, _ in samples), default=0)
    print(f"stopped after {stopped_at:.1f} s (exit {proc.returncode})")
    print(f"first answer: {first:.1f} s" if first is not None else "first answer: none")
    print(f"answers in {stopped_at:.1f} s: {answers}")
    if first is not None and stopped_at > first:
        print(f"rows/s after the first answer: {(answers - 1) / (stopped_at - first):.1f}")
    print(f"peak RSS sampled: {peak / gib:.2f} GiB; VmHWM: {hwm / gib:.2f} GiB")
    for mark in (15, 30, 60, 90, 120, 180, 240, 300, 420, 600, 900):
        at = [s for s in samples if s[0] <= mark]
        if at and mark <= stopped_at:
            t, rss, n, load = at[-1]
            print(f"  at {t:5.1f} s: RSS {rss / gib:.2f} GiB, {n} answers, load {load:.2f}")
    loads = [s[3] for s in samples]
    if loads:
        print(f"load average (1 min) while it ran: min {min(loads):.2f}, max {max(loads):.2f}")


if __name__ == "__main__":
    main()
