"""Config.resolve: every option's default written once (config.py) and used by `Config.resolve`,
`LLM(...)` and the command line alike; which options were asked as auto, kept as data; and which
value wins where two could apply (an explicit value over auto, a replaced option over the old)."""

from __future__ import annotations

import inspect

import pytest
import torch

from chunkgen import config as cfg
from chunkgen.config import Config, OptionError
from chunkgen.device import AUTO_MAX_BATCH, CPU_KV_MEMORY, Accelerator

NO_GPU = Accelerator(cuda=False, cuda_kernels=False)


# -- defaults -------------------------------------------------------------------------------------
def test_resolve_takes_its_defaults_from_the_module_constants():
    params = inspect.signature(Config.resolve).parameters
    assert params["device"].default == cfg.DEFAULT_DEVICE
    assert params["dtype"].default == cfg.DEFAULT_DTYPE
    assert params["kv_memory"].default == cfg.DEFAULT_KV_MEMORY
    assert params["max_batch"].default == cfg.DEFAULT_MAX_BATCH
    assert params["chunk_size"].default == cfg.DEFAULT_CHUNK_SIZE
    assert params["batch_invariant"].default == cfg.DEFAULT_BATCH_INVARIANT
    assert params["max_prefill_tokens"].default == cfg.DEFAULT_MAX_PREFILL_TOKENS
    assert params["model"].default == cfg.DEFAULT_MODEL


def test_nothing_given_is_every_default_decided_for_this_machine():
    config = Config.resolve(found=NO_GPU)
    assert config.model is None and config.dummy_weights is None  # the embedded default model
    assert config.device == "cpu" and config.why["device"] == "auto: no CUDA GPU"
    assert config.kv_memory == CPU_KV_MEMORY and config.why["kv_memory"].startswith("auto: 4.0 GiB on the CPU")
    assert config.max_batch == AUTO_MAX_BATCH and "KV budget" in config.why["max_batch"]
    assert config.chunk_size == cfg.DEFAULT_CHUNK_SIZE == 64
    assert config.max_prefill_tokens == cfg.DEFAULT_MAX_PREFILL_TOKENS
    assert config.batch_invariant is True and config.quantize == "auto" and config.order == "prefix"
    assert config.share_prefix and config.chunk_first and config.chat_template
    assert config.dtype in (torch.float32, torch.bfloat16) and config.why["dtype"].startswith("auto")
    assert config.kv_dtype == config.dtype  # the K/V cache keeps the model's dtype on the CPU
    assert config.auto == {"device", "dtype", "kv_memory", "max_batch", "batch_invariant"}


def test_the_dataclass_defaults_agree_with_resolve():
    """Config() (the engine's tests build one directly) runs what Config.resolve on a CPU would."""
    plain, resolved = Config(), Config.resolve(device="cpu", dtype="fp32")
    for name in ("device", "dtype", "kv_memory", "max_batch", "chunk_size", "max_prefill_tokens", "batch_invariant"):
        assert getattr(plain, name) == getattr(resolved, name), name


# -- auto recorded as data ------------------------------------------------------------------------
def test_config_records_which_options_were_auto():
    config = Config.resolve(device="cpu", dtype="auto", kv_memory="1GiB", max_batch="auto", batch_invariant="on")
    assert config.auto == {"dtype", "max_batch"}
    assert config.replace(max_batch=8).auto == {"dtype"}
    assert config.replace(kv_memory="auto").auto == {"dtype", "max_batch", "kv_memory"}
    assert Config.resolve(device="cpu", max_batch=" AUTO ").auto >= {"max_batch"}  # as the option is read
    given = Config.resolve(device="cpu", dtype="fp32", kv_memory="1GiB", max_batch=32, batch_invariant="off")
    assert given.auto == frozenset() and given.why["max_batch"] == "as asked"


def test_the_loaded_weights_settle_dtype_and_keep_what_was_auto():
    config = Config.resolve(device="cpu", dtype="auto", kv_memory="auto", found=NO_GPU)
    loaded = config.loaded(torch.bfloat16, dtype_reason="auto: the model's own dtype")
    assert loaded.dtype == torch.bfloat16 and loaded.why["dtype"] == "auto: the model's own dtype"
    assert loaded.auto == config.auto and loaded.kv_memory == config.kv_memory


# -- which value wins -----------------------------------------------------------------------------
def test_an_explicit_kv_dtype_wins_over_the_models():
    assert Config.resolve(device="cpu", dtype="fp32", kv_dtype="bf16").kv_dtype == torch.bfloat16
    assert Config.resolve(device="cpu", dtype="fp32").kv_dtype == torch.float32
    # fp16 weights on the CPU keep fp32 K/V unless a K/V dtype is given
    assert Config.resolve(device="cpu", dtype="fp16").kv_dtype == torch.float32
    assert Config.resolve(device="cpu", dtype="fp16", kv_dtype="bf16").kv_dtype == torch.bfloat16


def test_replace_checks_raw_values_as_resolve_does():
    config = Config.resolve(device="cpu", dtype="fp32", kv_memory="1GiB", max_batch=8)
    again = config.replace(max_batch="auto", kv_memory="512MiB", batch_invariant="on")
    assert again.max_batch == AUTO_MAX_BATCH and again.kv_memory == 512 << 20 and again.batch_invariant is True
    assert again.why["kv_memory"] == "as asked" and "KV budget" in again.why["max_batch"]
    assert config.max_batch == 8  # the original is left as it was
    with pytest.raises(OptionError) as bad:
        config.replace(max_batch=0)
    assert bad.value.option == "--max-batch"


@pytest.mark.parametrize(
    "options,option",
    [
        ({"chunk_size": 24}, "--chunk-size"),
        ({"order": "random"}, "--order"),
        ({"kv_memory": "lots"}, "--kv-memory"),
        ({"max_batch": "many"}, "--max-batch"),
        ({"dtype": "fp8"}, "--dtype"),
        ({"device": "tpu"}, "--device"),
        ({"batch_invariant": "maybe"}, "--batch-invariant"),
        ({"model": "m", "dummy_weights": "smollm2-135m"}, "--dummy-weights"),
    ],
)
def test_a_bad_value_names_its_option(options, option):
    with pytest.raises(OptionError) as bad:
        Config.resolve(**{"device": "cpu", **options})
    assert bad.value.option == option and bad.value.usage


def test_a_gpu_asked_for_on_a_machine_without_one_is_not_a_usage_error():
    with pytest.raises(OptionError) as bad:
        Config.resolve(device="cuda", found=NO_GPU)
    assert bad.value.option == "--device" and not bad.value.usage
