"""The device choices (auto, cuda:N, the KV budget, the batch) and the device guard: everything
about where a model runs that does not need a GPU to be checked."""

from __future__ import annotations

import contextlib

import pytest
import torch

from chunkgen import device as devmod
from chunkgen.device import GPU_KV_FRACTION, Accelerator, choose_device, choose_kv_memory, device_guard, on_model_device
from chunkgen.engine import Request, SamplingParams

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


# -- the KV budget and the batch ------------------------------------------------------------------
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


def test_max_batch_auto_is_a_cap_the_kv_budget_fills_and_a_number_is_taken_as_asked():
    from chunkgen.device import AUTO_MAX_BATCH, choose_max_batch

    auto = choose_max_batch("auto")
    assert auto.rows == AUTO_MAX_BATCH == 256 and "KV budget" in auto.reason
    assert choose_max_batch(" AUTO ").rows == 256
    assert choose_max_batch("48") == choose_max_batch(48) and choose_max_batch(48).rows == 48
    for bad in ("0", 0, -3, "lots", "4.5", True, 2.0):
        with pytest.raises(ValueError, match="must be"):
            choose_max_batch(bad)


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
