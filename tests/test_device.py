"""The device choices (auto, cuda:N, the KV budget), the device guard, one KV reservation per LLM
and random-weight models from a config: everything that does not need a GPU to be checked."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from typer.testing import CliRunner

from chunkgen import device as devmod
from chunkgen.cache import ChunkPool
from chunkgen.cli import app
from chunkgen.device import GPU_KV_FRACTION, Accelerator, choose_device, choose_kv_memory, device_guard, on_model_device
from chunkgen.engine import Request, SamplingParams
from chunkgen.model import dummy
from tests.helpers import PROMPTS

runner = CliRunner()
GPU = Accelerator(cuda=True, cuda_kernels=True, current=0)
NO_GPU = Accelerator(cuda=False, cuda_kernels=False)
GPU_NO_KERNELS = Accelerator(cuda=True, cuda_kernels=False)


# -- choosing the device ------------------------------------------------------------------------
def test_auto_picks_the_gpu_only_with_the_cuda_kernels_and_says_why():
    got = choose_device("auto", GPU)
    assert got.device == "cuda:0" and "CUDA GPU" in got.reason
    assert choose_device("auto", Accelerator(True, True, current=2)).device == "cuda:2"
    cpu = choose_device("auto", NO_GPU)
    assert cpu.device == "cpu" and cpu.reason == "auto: no CUDA GPU"
    built_without = choose_device("auto", GPU_NO_KERNELS)
    assert built_without.device == "cpu" and "without its CUDA kernels" in built_without.reason


def test_named_devices_are_taken_as_given_and_checked():
    assert choose_device("cpu", GPU) == devmod.DeviceChoice("cpu", "as asked")
    assert choose_device("cuda", Accelerator(True, True, current=1)).device == "cuda:1"  # named by index
    assert choose_device("cuda:3", GPU).device == "cuda:3"
    for found in (NO_GPU, GPU_NO_KERNELS):
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            choose_device("cuda", found)
    for bad in ("tpu", "cuda:", "cuda:x", "CPU", "gpu"):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            choose_device(bad, GPU)


def test_the_llm_resolves_auto_with_what_the_machine_has(tiny_model, monkeypatch):
    from chunkgen.llm import LLM

    monkeypatch.setattr("chunkgen.config.detect", lambda: GPU_NO_KERNELS)
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="16MiB")  # device: auto
    assert llm.device == "cpu" and "without its CUDA kernels" in llm.config.why["device"]
    monkeypatch.setattr("chunkgen.config.detect", lambda: NO_GPU)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        LLM(model=str(tiny_model), device="cuda:0", kv_memory="16MiB")


# -- the KV budget ------------------------------------------------------------------------------
def test_kv_memory_auto_is_a_share_of_free_gpu_memory_and_4gib_on_the_cpu():
    free = 70 << 30
    gpu = choose_kv_memory("auto", "cuda:1", free=free)
    assert gpu.bytes == int(free * GPU_KV_FRACTION) and 0.8 <= GPU_KV_FRACTION <= 0.9
    assert gpu.reason.startswith("auto: 85% of the 70.0 GiB")
    cpu = choose_kv_memory("auto", "cpu", free=free)  # the CPU's free memory does not matter
    assert cpu.bytes == 4 << 30 and cpu.reason.startswith("auto: 4.0 GiB on the CPU")
    assert choose_kv_memory("2GiB", "cuda:0", free=free) == devmod.KVBudget(2 << 30, "as asked")
    with pytest.raises(ValueError, match="free GPU memory"):
        choose_kv_memory("auto", "cuda:0")
    with pytest.raises(ValueError, match="size"):
        choose_kv_memory("lots", "cpu")


# -- the device guard ---------------------------------------------------------------------------
class _Recorder:
    """Stands in for torch.cuda.device: notes each index entered, and which one is current."""

    def __init__(self) -> None:
        self.entered: list[int] = []
        self.current: int | None = None

    def __call__(self, index: int):
        @contextlib.contextmanager
        def guard():
            before, self.current = self.current, index
            self.entered.append(index)
            try:
                yield
            finally:
                self.current = before

        return guard()


def test_device_guard_enters_the_devices_index(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "device", rec)
    with device_guard("cuda:3"):
        assert rec.current == 3
    with device_guard(torch.device("cuda", 1)):
        assert rec.current == 1
    with device_guard("cpu"):
        assert rec.current is None
    assert rec.entered == [3, 1]

    class Runner:
        class model:
            device = torch.device("cuda:2")

        @on_model_device
        def step(self) -> int | None:
            return rec.current

    assert Runner().step() == 2 and rec.current is None  # entered for the call, left after


def test_engine_steps_run_under_the_guard_of_the_models_device(tiny_llm, monkeypatch):
    seen: list[torch.device] = []

    def recording_guard(device):
        seen.append(torch.device(device))
        return contextlib.nullcontext()

    monkeypatch.setattr(devmod, "device_guard", recording_guard)
    engine = tiny_llm.new_engine()
    steps = 0
    for _ in engine.stream([Request(0, tiny_llm.encode("Hello there"), SamplingParams(max_new_tokens=3))]):
        pass
    steps = engine.stats.decode_steps + 1  # the prefill wave, then the decode steps
    assert len(seen) >= steps + 1  # building the engine's cache, then every step
    assert set(seen) == {torch.device(tiny_llm.device)}


# -- one KV reservation per LLM -----------------------------------------------------------------
def _count_reservations(monkeypatch) -> list[int]:
    """Counts ChunkPools that reserve K/V storage of their own (not over another pool's)."""
    made: list[int] = []
    original = ChunkPool.__init__

    def counting(self, *args, **kwargs):
        if kwargs.get("tensors") is None and kwargs.get("storage", True):
            made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ChunkPool, "__init__", counting)
    return made


def _answers(engine, prompts: list[list[int]], new: int = 8) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for r in engine.stream([Request(i, p, SamplingParams(max_new_tokens=new)) for i, p in enumerate(prompts)]):
        out[r.id] = r.token_ids
    return [out[i] for i in range(len(prompts))]


def test_engines_of_one_llm_take_turns_on_one_reservation(tiny_model, monkeypatch):
    from chunkgen.llm import LLM
    from tests.helpers import template_prompts

    made = _count_reservations(monkeypatch)
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=8)
    assert len(made) == 1
    a, b = llm.new_engine(), llm.new_engine(kv_memory=16 << 20)  # smaller: fits the reservation
    assert len(made) == 1
    assert a.pool.k.data_ptr() == b.pool.k.data_ptr() == llm.engine.pool.k.data_ptr()
    assert b.pool.max_slots < a.pool.max_slots and b.pool.scratch_slot == b.pool.max_slots
    prompts = [llm.encode(p) for p in template_prompts("tool_dispatcher", 6)]
    first = _answers(a, prompts)
    # b overwrites the storage a's cached prefixes were in; a, given requests again, starts afresh
    # (reading its old cache would give other answers)
    _answers(b, [llm.encode(p) for p in template_prompts("document_qa", 6)])
    assert a.tree.cached_chunks > 0 and b.tree.cached_chunks > 0
    assert _answers(a, prompts) == first
    assert a.stats.prompt_tokens == 2 * sum(map(len, prompts))
    assert len(made) == 1
    # A larger budget than the reservation's gets a pool of its own.
    big = llm.new_engine(kv_memory=128 << 20)
    assert len(made) == 2 and big.pool.k.data_ptr() != a.pool.k.data_ptr()


def test_an_engine_with_requests_keeps_the_reservation(tiny_llm):
    a, b = tiny_llm.new_engine(), tiny_llm.new_engine()
    prompt = tiny_llm.encode("Hello there")
    a.add([Request(0, prompt, SamplingParams(max_new_tokens=4))])
    with pytest.raises(RuntimeError, match="still has requests"):
        b.add([Request(1, prompt, SamplingParams(max_new_tokens=4))])
    assert len(list(a.stream())) == 1
    b.add([Request(1, prompt, SamplingParams(max_new_tokens=4))])  # a is done: b takes over
    assert [r.id for r in b.stream()] == [1]


# -- random weights from a config ---------------------------------------------------------------
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 500,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


def test_shipped_configs_have_the_models_shapes():
    sizes = {
        name: sum(p.numel() for p in dummy._skeleton(dummy.load_config(name), torch.bfloat16).parameters())
        for name in dummy.SHIPPED
    }
    assert round(sizes["smollm2-135m"] / 1e6) == 135
    assert round(sizes["llama-3.2-1b"] / 1e9, 2) == 1.24
    assert round(sizes["llama-2-7b"] / 1e9, 2) == 6.74
    assert round(sizes["qwen3-0.6b"] / 1e6) == 596 and round(sizes["qwen3-4b"] / 1e9, 2) == 4.02
    assert round(sizes["gemma-3-1b"] / 1e6) == 1000 and round(sizes["phi-3-mini"] / 1e9, 2) == 3.82
    assert dummy.weight_bytes(dummy.load_config("llama-2-7b"), torch.bfloat16) == 2 * sizes["llama-2-7b"]
    with pytest.raises(dummy.DummyWeightsError, match="not a shipped config"):
        dummy.config_path("llama-9")


def test_random_weights_are_seeded_and_built_in_the_asked_dtype(tiny_config):
    config = dummy.load_config(tiny_config)
    state = torch.random.get_rng_state()
    a = dummy.random_model(config, torch.bfloat16, "cpu", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG untouched
    b = dummy.random_model(config, torch.bfloat16, "cpu", seed=3)
    c = dummy.random_model(config, torch.bfloat16, "cpu", seed=4)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.layers.0.self_attn.q_proj.weight"], pc["model.layers.0.self_attn.q_proj.weight"])


def test_too_large_random_weights_are_refused_before_anything_is_built():
    config = dummy.load_config("llama-2-7b")
    with pytest.raises(dummy.DummyWeightsError, match=r"fp32 are 25.1 GiB.*more than the 24.0 GiB memory available"):
        dummy.check_fits(config, torch.float32, "cpu", 24 << 30)
    assert dummy.check_fits(config, torch.bfloat16, "cuda:0", 78 << 30) <= 2.1 * 12.6 * 2**30
    with pytest.raises(dummy.DummyWeightsError, match="transformers' copy"):
        dummy.check_fits(config, torch.bfloat16, "cuda:0", 30 << 30, copies=2)


def test_a_vocabulary_no_tokenizer_fits_runs_on_token_ids(tiny_config):
    from chunkgen.llm import LLM

    llm = LLM(dummy_weights=str(tiny_config), dtype="fp32", kv_memory="16MiB", chunk_size=16)
    assert llm.model_path is None and llm.model.vocab_size == 500
    assert getattr(llm.tokenizer, "ids_only", False)  # the default tokenizer's 49152 ids do not fit
    with pytest.raises(TypeError, match="token ids"):
        llm.encode("text")
    [res] = llm.generate([[5, 17, 42, 99]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(res.token_ids) == 4 and all(0 <= t < 500 for t in res.token_ids)
    assert res.text == " ".join(map(str, res.token_ids))


def test_bench_e2e_dummy_weights_on_a_tiny_config_matches_transformers(tiny_config, tmp_path):
    out = tmp_path / "rows.json"
    res = runner.invoke(
        app,
        [
            "bench",
            "e2e",
            "--dummy-weights",
            str(tiny_config),
            "--dtype",
            "fp32",
            "--n-shared",
            "80",
            "--n-queries",
            "3",
            "--max-new-tokens",
            "6",
            "--systems",
            "hf,chunkgen",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "device cpu (as asked)" in res.output and "KV budget " in res.output
    assert "(auto: " in res.output.split("KV budget ", 1)[1].splitlines()[0]  # --kv-memory's default
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert rows["chunkgen"]["outputs_equal_to_hf"] >= 2  # random weights: a near tie may flip one
    assert rows["chunkgen"]["kv_peak_bytes"] > 0


def test_bench_e2e_gives_a_row_per_batch_and_the_first_round_apart(tiny_config, tmp_path):
    out = tmp_path / "rows.json"
    res = runner.invoke(
        app,
        [
            "bench",
            "e2e",
            "--dummy-weights",
            str(tiny_config),
            "--dtype",
            "fp32",
            "--n-shared",
            "40",
            "--n-queries",
            "3",
            "--max-new-tokens",
            "3",
            "--repeat",
            "2",
            "--systems",
            "chunkgen",
            "--max-batch",
            "auto,2",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    rows = {r["max_batch"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"auto", "2"} and rows["auto"]["peak_batch"] == 3 and rows["2"]["peak_batch"] == 2
    assert all(len(r["gen_tokens_per_s_runs"]) == 2 for r in rows.values())
    assert "round 1 gen tok/s" in res.output and "auto (peak 3)" in res.output
    bad = runner.invoke(app, ["bench", "e2e", "--dummy-weights", str(tiny_config), "--max-batch", "auto,zero"])
    assert bad.exit_code == 2 and "--max-batch" in bad.output


def test_the_memory_check_does_not_under_estimate_fp32():
    """fp32 on the CPU keeps a packed copy for the decode product too: the estimate counts it."""
    from chunkgen.bench.e2e import PeakRSS
    from chunkgen.llm import LLM

    config = dummy.load_config("smollm2-135m")
    with PeakRSS() as rss:
        start = rss.peak
        llm = LLM(dummy_weights="smollm2-135m", dtype="fp32", device="cpu", kv_memory="64MiB")
    assert llm.model.layers[0].gate_up.decode_packed is not None
    assert rss.peak - start <= dummy.weight_bytes(config, torch.float32) * dummy.peak_factor("cpu", torch.float32)


@pytest.mark.real_model
def test_bench_e2e_dummy_smollm2_shapes_use_the_default_tokenizer(default_model_dir, tmp_path):
    from chunkgen.bench.e2e import PeakRSS
    from chunkgen.llm import LLM

    config = dummy.load_config("smollm2-135m")
    with PeakRSS() as rss:
        start = rss.peak
        llm = LLM(dummy_weights="smollm2-135m", dtype="bf16", device="cpu", kv_memory="64MiB")
    estimate = dummy.weight_bytes(config, torch.bfloat16) * dummy.peak_factor("cpu", torch.bfloat16)
    assert rss.peak - start <= estimate  # the memory check does not under-estimate
    assert not getattr(llm.tokenizer, "ids_only", False) and llm.model.dtype == torch.bfloat16
    out = tmp_path / "rows.json"
    res = runner.invoke(
        app,
        [
            "bench",
            "e2e",
            "--dummy-weights",
            "smollm2-135m",
            "--dtype",
            "bf16",
            "--device",
            "cpu",
            "--n-shared",
            "64",
            "--n-queries",
            "2",
            "--max-new-tokens",
            "3",
            "--systems",
            "chunkgen_paged,chunkgen",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["chunkgen_paged", "chunkgen"] and all(r["dtype"] == "bf16" for r in rows)


def test_bench_e2e_refuses_weights_that_do_not_fit(monkeypatch):
    monkeypatch.setattr(devmod, "free_bytes", lambda device: 8 << 30)
    res = runner.invoke(app, ["bench", "e2e", "--dummy-weights", "llama-2-7b", "--dtype", "fp32", "--device", "cpu"])
    assert res.exit_code == 1 and "more than the 8.0 GiB memory available" in res.output
    assert "--dtype bf16 halves it" in res.output and "leave hf out of --systems" in res.output
    res = runner.invoke(app, ["bench", "e2e", "--dummy-weights", "no-such-model", "--device", "cpu"])
    assert res.exit_code == 1 and "not a shipped config" in res.output


# -- what the run says ---------------------------------------------------------------------------
def test_the_run_summary_names_the_device_and_the_kv_budget(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    res = runner.invoke(
        app,
        [
            "run",
            "-t",
            str(PROMPTS / "arithmetic_cot.toml"),
            "-q",
            str(PROMPTS / "arithmetic_cot.queries.jsonl"),
            "-o",
            str(out),
            "--model",
            str(tiny_model),
            "--chunk-size",
            "16",
            "--max-new-tokens",
            "2",
            "--dtype",
            "fp32",
            "--json-log",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    summary = json.loads([l for l in res.output.splitlines() if '"summary"' in l][-1])
    want = choose_device("auto", devmod.detect())
    assert summary["device"] == f"{want.device} ({want.reason})"
    if want.device == "cpu":
        assert summary["kv_memory"].startswith("4.0 GiB (auto: 4.0 GiB on the CPU")


def test_max_batch_auto_is_a_cap_the_kv_budget_fills_and_a_number_is_taken_as_asked():
    from chunkgen.device import AUTO_MAX_BATCH, choose_max_batch

    auto = choose_max_batch("auto")
    assert auto.rows == AUTO_MAX_BATCH == 256 and "KV budget" in auto.reason
    assert choose_max_batch(" AUTO ").rows == 256
    assert choose_max_batch("48") == choose_max_batch(48) and choose_max_batch(48).rows == 48
    for bad in ("0", 0, -3, "lots", "4.5", True, 2.0):
        with pytest.raises(ValueError, match="must be"):
            choose_max_batch(bad)
