"""Ray scale-out on a local cluster: the same records as a local run, workers that live for the
whole job (one model load each), a worker killed mid-group replaced without losing or doubling a
record, the output lock held under --ray, and the resources workers ask for."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from chunkgen.scale.ray import WorkerShape, actor_options, choose_worker, plan_workers  # noqa: E402
from tests.helpers import PROMPTS, base_args, records, run_cli  # noqa: E402

# Its clusters take the machine's CPUs as their own, and its timeouts assume them free.
pytestmark = pytest.mark.serial


def test_workers_are_sized_from_the_cluster():
    gpus = plan_workers("cuda", None, {"CPU": 16.0, "GPU": 4.0}, [16.0])
    assert gpus == WorkerShape(count=4, num_cpus=1.0, num_gpus=1, threads=1)
    assert actor_options(gpus)["num_gpus"] == 1
    assert plan_workers("cuda:0", 2, {"CPU": 1.0, "GPU": 4.0}, [1.0]) == WorkerShape(2, 0.5, 1, 1)
    with pytest.raises(ValueError, match="needs 5 GPUs; the Ray cluster has 4"):
        plan_workers("cuda", 5, {"CPU": 16.0, "GPU": 4.0}, [16.0])
    with pytest.raises(ValueError, match="no GPUs"):
        plan_workers("cuda", None, {"CPU": 16.0}, [16.0])
    assert plan_workers("cpu", None, {"CPU": 2.0}, [2.0]) == WorkerShape(2, 1.0, 0, 1)
    assert plan_workers("cpu", 1, {"CPU": 2.0}, [2.0]) == WorkerShape(1, 2.0, 0, 2)
    assert plan_workers("cpu", 4, {"CPU": 2.0}, [2.0]) == WorkerShape(4, 0.5, 0, 1)
    assert plan_workers("cpu", 3, {"CPU": 2.0}, [2.0]).num_cpus == 0.66  # rounded down: all three fit
    assert plan_workers("cpu", 1, {"CPU": 64.0}, [32.0, 32.0]).num_cpus == 32.0  # no more than one machine has
    cpu = actor_options(plan_workers("cpu", 2, {"CPU": 2.0}, [2.0]))
    assert cpu == {"num_cpus": 1.0, "num_gpus": 0, "max_concurrency": 4}


def test_a_group_goes_to_the_worker_holding_its_prefix():
    assert choose_worker([], [5, 2, 9], capacity=10) == 1  # a new group: the least-loaded worker
    assert choose_worker([2], [0, 0, 9], capacity=10) == 2  # its holder, though others are idle
    assert choose_worker([0, 2], [7, 0, 3], capacity=10) == 2  # the least-loaded holder
    assert choose_worker([0], [10, 4, 6], capacity=10) == 1  # holder full: a worker at most half full
    assert choose_worker([0], [10, 6, 7], capacity=10) is None  # ...else wait for the holder
    assert choose_worker([], [10, 10], capacity=10) is None  # everyone full: wait


@pytest.fixture(scope="module")
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def summary_of(output: str) -> dict:
    return json.loads([l for l in output.splitlines() if l.startswith('{"event": "summary"')][-1])


def key(r: dict) -> str:
    return r.get("id") or f"line:{r['line']}"


def test_a_worker_killed_mid_group_is_replaced_and_nothing_is_lost_or_doubled(
    tiny_model, tmp_path, local_cluster, monkeypatch
):
    import chunkgen.scale.ray as scale_ray
    from chunkgen.jobs.lock import OutputLock, OutputLocked
    from chunkgen.jobs.writer import ResultWriter

    queries = tmp_path / "mixed.jsonl"
    rows = [{"id": f"m{i}", "template": "arithmetic_cot", "question": f"What is {i} + 1?"} for i in range(10)]
    rows += [{"id": f"d{i}", "template": "document_qa", "question": f"Question {i}?"} for i in range(3)]
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    args = [
        *base_args(tiny_model, tmp_path / "local.jsonl", queries=queries, template=PROMPTS),
        "--max-batch",
        "2",
        "--max-new-tokens",
        "4",
    ]
    assert run_cli(*args).exit_code == 3
    want = {key(r): r.get("text") for r in records(tmp_path / "local.jsonl")}

    marker = tmp_path / "crashed"
    from tests.scale.ray_faults import CrashOnceWorker

    # one worker dies once, after handing back 2 records
    monkeypatch.setattr(CrashOnceWorker, "crash_after", (2, marker))
    monkeypatch.setattr(scale_ray, "EngineWorker", CrashOnceWorker)
    dist = tmp_path / "ray.jsonl"
    real_run, locked = scale_ray.run_on_ray, []

    def run_while_checking_the_lock(*a, **kw):  # the writer holds --out for the whole Ray run
        with pytest.raises(OutputLocked, match="being written by another chunkgen run"):
            ResultWriter(dist, "template", "tiny", resume=True)
        locked.append(True)
        return real_run(*a, **kw)

    monkeypatch.setattr(scale_ray, "run_on_ray", run_while_checking_the_lock)
    args[args.index("--out") + 1] = str(dist)
    res = run_cli(*args, "--ray", "--workers", "2", "--json-log")
    assert res.exit_code == 3, res.output
    assert locked
    OutputLock(dist).acquire().release()  # the run let its lock go: OutputLocked otherwise
    handed = json.loads(marker.read_text())  # the input indexes the dead worker's records were written for
    assert len(handed) >= 2
    got = records(dist)
    assert sorted(map(key, got)) == sorted(want)  # every record exactly once
    assert {key(r): r.get("text") for r in got} == want
    group = rows[handed[0]]["template"]  # killed mid-group: rows of that group were answered after it died
    assert sum(r["template"] == group for r in rows) > sum(rows[i]["template"] == group for i in handed)
    summary = summary_of(res.output)
    assert summary["workers"] == 2 and summary["model_loads"] == 3 and summary["requests"] == 13
    assert summary["prefill_s"] > 0 and len(summary["kv_peak_bytes_per_worker"]) == 3
    again = run_cli(*args, "--ray", "--resume", "--json-log")
    # resume: nothing left to answer (no worker started); the bad line is reported again (replaced, not doubled)
    assert again.exit_code == 3 and "0 answered" in again.output and summary_of(again.output)["model_loads"] == 0
    assert sorted(map(key, records(dist))) == sorted(want)


def test_a_worker_that_cannot_load_the_model_ends_the_job_in_one_line(tiny_model, tmp_path, local_cluster):
    """Only a failure of the worker's own start-up ends the job; a worker lost another way is replaced
    (the test above, and the two-node test below where one dies before handing back a record)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # the driver does not load weights: the workers do
    out = tmp_path / "out.jsonl"
    args = base_args(model, out)
    res = run_cli(*args, "--ray", "--workers", "1")
    assert res.exit_code == 1, res.output
    message = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(message) == 1 and "a Ray worker failed to start" in message[0], res.output
    assert "cannot load the weights" in message[0] and "Traceback" not in res.output, res.output


def test_a_long_run_loads_the_model_once_per_worker(tiny_model, tmp_path, local_cluster):
    """More rows than the old 16,384-row windows: two workers, two model loads, a local run's answers."""
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "a.toml").write_text('name = "short_a"\nsystem = "You answer in one word."\nuser = "Q: {question}"\n')
    (templates / "b.toml").write_text('name = "short_b"\nsystem = "You reply with one token."\nuser = "{question}?"\n')
    queries = tmp_path / "many.jsonl"
    n = 16_500
    queries.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "template": "short_b" if i % 3 == 0 else "short_a", "question": str(i)}) + "\n"
            for i in range(n)
        )
    )
    args = [
        *base_args(tiny_model, tmp_path / "local.jsonl", queries=queries, template=templates),
        "--max-new-tokens",
        "1",
        "--max-batch",
        "64",
        "--json-log",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the two workers runs on this 2-core machine
    try:
        local = run_cli(*args)
    finally:
        torch.set_num_threads(threads)
    assert local.exit_code == 0, local.output
    args[args.index("--out") + 1] = str(tmp_path / "ray.jsonl")
    res = run_cli(*args, "--ray", "--workers", "2")
    assert res.exit_code == 0, res.output
    summary = summary_of(res.output)
    assert summary["model_loads"] == 2 and summary["workers"] == 2 and summary["requests"] == n
    assert summary["cache_hit_rate"] > 0.5 and min(summary["kv_peak_bytes_per_worker"]) > 0
    got = {r["id"]: r["text"] for r in records(tmp_path / "ray.jsonl")}
    assert len(got) == n and got == {r["id"]: r["text"] for r in records(tmp_path / "local.jsonl")}


def test_an_engine_worker_answers_rows_sent_after_its_finish_call(tiny_model):
    """A threaded actor's calls may run out of order: `finish(n)` waits for all n rows; rows of a
    second group join the engine while the first decodes (in-process, no cluster)."""
    from chunkgen.config import Config
    from chunkgen.engine import SamplingParams
    from chunkgen.jobs.requests import Job
    from chunkgen.scale.ray import EngineWorker

    config = Config.resolve(str(tiny_model), chunk_size=16, kv_memory="64MiB", max_batch=4)
    worker = EngineWorker(config, "template", "tiny", threads=1)

    def job(i: int, system: str, new: int) -> tuple[int, Job]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        return i, Job(f"r{i}", i + 1, messages, SamplingParams(max_new_tokens=new, temperature=0.0))

    worker.submit([job(i, "first prompt " * 10, 24) for i in range(3)])
    worker.finish(6)  # before the last rows arrive
    got = worker.collect(0.0)[0]  # the first group is in the engine now
    worker.submit([job(i, "second prompt " * 10, 2) for i in range(3, 6)])  # while the first decodes
    deadline = time.monotonic() + 120
    while len(got) < 6 and time.monotonic() < deadline:
        got += worker.collect(0.5)[0]
    assert sorted(i for i, _, _ in got) == list(range(6))
    assert {i for i, _, _ in got[:3]} & {3, 4, 5}, "the second group waited for the first to finish"
    stats = worker.collect(0.1)[1]
    assert stats.prompt_tokens > 0 and stats.decode_s > 0


def test_an_engine_worker_drains_its_rows_in_flight_and_starts_no_other(tiny_model):
    """`drain`: the rows then running are answered, the queued ones and rows sent later are not
    started, and collect says when nothing is in flight (in-process, no cluster)."""
    from chunkgen.config import Config
    from chunkgen.engine import SamplingParams
    from chunkgen.jobs.requests import Job
    from chunkgen.scale.ray import EngineWorker

    config = Config.resolve(str(tiny_model), chunk_size=16, kv_memory="64MiB", max_batch=4)
    worker = EngineWorker(config, "template", "tiny", threads=1)
    engine = worker.llm.engine
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    rows = [(i, Job(f"r{i}", i + 1, [{"role": "user", "content": f"question {i}"}], params)) for i in range(12)]
    worker.submit(rows)
    deadline = time.monotonic() + 120
    while engine.stats.generated_tokens < 8 and time.monotonic() < deadline:  # rows are decoding
        time.sleep(0.01)
    worker.drain()
    worker.submit([(12, Job("r12", 13, [{"role": "user", "content": "late"}], params))])
    got, drained = [], False
    while not drained and time.monotonic() < deadline:
        answered, _, drained = worker.collect(0.5)
        got += answered
    assert drained and not engine.has_work
    assert 1 <= len(got) <= 4 and all(i < 4 for i, _, _ in got)  # the first batch of 4, no other row


def test_a_killed_driver_leaves_no_process_of_its_cluster(tiny_model, tmp_path):
    """SIGKILL of a `--ray` driver that started its own local cluster: its watcher stops every
    process of that cluster (Ray's own clean-up never runs after SIGKILL)."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from tests.helpers import ROOT

    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": f"r{i}", "question": f"{i} + {i}?"}) + "\n" for i in range(200)))
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    args = base_args(tiny_model, out, queries=queries)
    args[args.index("--max-new-tokens") + 1] = "32"
    driver = subprocess.Popen(
        [sys.executable, "-m", "chunkgen", *args, "--ray", "--workers", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (out.exists() and out.stat().st_size):
        time.sleep(0.2)
    assert out.exists() and out.stat().st_size, "no record within 3 minutes"
    cluster = psutil.Process(driver.pid).children(recursive=True)
    named = _names(cluster)  # a short-lived helper may end between the listing and its name
    assert any("raylet" in n for n in named.values()), named
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    _, alive = psutil.wait_procs(cluster, timeout=30)
    left = sorted(_names(alive).items())
    for p in alive:  # leave the machine clean whatever the verdict
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, left


def _names(procs) -> dict[int, str]:
    """pid -> name of each process still there to be named (one that has ended is not left over)."""
    import psutil

    named = {}
    for p in procs:
        try:
            named[p.pid] = p.name()
        except psutil.NoSuchProcess:
            continue
    return named


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_two_node_cluster_losing_a_node_mid_job_ends_on_the_node_left_with_a_local_runs_answers(tiny_model, tmp_path):
    """A real cluster on this machine: `ray start --head` and a second `ray start --address` node,
    each its own process tree. The second node is killed (SIGKILL) while the job runs; the job ends
    on the node left, every id with one record, the answers a local run gives; `--resume` finds
    nothing left to do."""
    import os
    import subprocess
    import sys

    import psutil

    from tests.helpers import ROOT

    ray_cli = str(Path(sys.executable).with_name("ray"))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        # Ray marks a killed node dead after three missed half-second health checks (the default,
        # five of three seconds, made this test wait 15 s for it).
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "3",
    }
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[subprocess.Popen] = []

    def start_node(*args: str) -> subprocess.Popen:
        node = subprocess.Popen(
            [ray_cli, "start", "--block", "--num-cpus", "2", "--disable-usage-stats", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        nodes.append(node)
        return node

    def kill_tree(node: subprocess.Popen) -> None:
        try:
            family = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        except psutil.Error:
            return
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=10)

    def alive_nodes() -> int:
        import socket

        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return 0
        probe = (
            f"import ray; ray.init(address={address!r}, log_to_driver=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        return int(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 and res.stdout.strip() else 0

    queries = tmp_path / "q.jsonl"
    rows = [{"id": f"m{i}", "template": "arithmetic_cot", "question": f"What is {i} + {i}?"} for i in range(40)]
    rows += [{"id": f"d{i}", "template": "document_qa", "question": f"Question {i}?"} for i in range(40)]
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        *base_args(tiny_model, tmp_path / "local.jsonl", queries=queries, template=PROMPTS),
        "--max-batch",
        "4",
        "--max-new-tokens",
        "24",
    ]
    assert run_cli(*args).exit_code == 0
    want = {r["id"]: r["text"] for r in records(tmp_path / "local.jsonl")}
    out = tmp_path / "cluster.jsonl"
    args[args.index("--out") + 1] = str(out)
    command = [sys.executable, "-m", "chunkgen", *args, "--ray", "--ray-address", address, "--workers", "2"]
    try:
        import tempfile

        short = tempfile.mkdtemp(prefix="cg-ray-", dir="/tmp")  # Ray's socket paths must stay short
        start_node("--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", short)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and alive_nodes() < 1:
            time.sleep(1)
        second = start_node("--address", address)
        while time.monotonic() < deadline and alive_nodes() < 2:
            time.sleep(1)
        assert alive_nodes() == 2, "the two-node cluster did not come up"
        driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (out.exists() and len(out.read_text().splitlines()) >= 4):
            time.sleep(0.2)
        written = len(out.read_text().splitlines())
        assert 4 <= written < len(rows), "the job ended before a node could be killed mid-job"
        kill_tree(second)  # a node lost mid-job: its raylet, its worker, its agents
        # Its worker's replacement has no room on the node left (no CPUs free): once Ray has marked
        # the node dead, the driver gives that worker up and the worker left answers its rows.
        try:
            _, stderr = driver.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            driver.kill()
            raise AssertionError("the job waited for a worker the cluster has no room for") from None
        assert driver.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
        resumed = subprocess.run([*command, "--resume"], env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0 and "0 answered" in resumed.stderr + resumed.stdout, resumed.stderr[-3000:]
    finally:
        for node in reversed(nodes):
            kill_tree(node)
        if "short" in locals():
            import shutil

            shutil.rmtree(short, ignore_errors=True)
    got = records(out)
    assert sorted(r["id"] for r in got) == sorted(want)  # every id exactly once
    assert {r["id"]: r["text"] for r in got} == want
