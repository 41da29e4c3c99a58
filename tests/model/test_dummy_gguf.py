"""Random-weight GGUF files of a config's shapes (model/dummy_gguf.py), what `bench e2e
--dummy-weights CONFIG --systems ...,llama_cpp` runs both systems on: written once and cached,
read by transformers' GGUF loader as by chunkgen's, with the same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType

from chunkgen.engine import SamplingParams
from chunkgen.model import dummy_gguf
from chunkgen.model.dummy import DummyWeightsError
from chunkgen.model.gguf_file import GGUFFile
from tests.helpers import TINY_CONFIG


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_written_once_and_read_alike_by_transformers_and_chunkgen(tiny_config, cache):
    from transformers import AutoModelForCausalLM

    from chunkgen.llm import LLM

    path, written = dummy_gguf.ensure(str(tiny_config), "q8_0", seed=1)
    assert written and path.parent == cache / "dummy-gguf"
    assert dummy_gguf.ensure(str(tiny_config), "q8_0", seed=1) == (path, False)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind
    file = GGUFFile(path, strings=("tokenizer.ggml.tokens",))
    assert file.field("llama.embedding_length") == 64 and file.field("llama.attention.head_count_kv") == 2
    assert len(file.field("tokenizer.ggml.tokens")) == TINY_CONFIG["vocab_size"]  # the default model's, cut
    kinds = {name: GGMLQuantizationType(t.tensor_type).name for name, t in file.tensors.items()}
    assert kinds["blk.1.ffn_down.weight"] == kinds["output.weight"] == "Q8_0" and kinds["output_norm.weight"] == "F32"

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="fp32", quantize="none", chunk_size=16, kv_memory="64MiB", max_batch=4)
    prompts = [[1, 17, 45, 300, 12, 9, 81], [1, 17, 45, 300, 499, 3]]
    got = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert out.token_ids == ref[0, len(ids) :].tolist()


def test_q4_k_files_keep_the_output_layer_in_q6_k(tmp_path):
    shape = dict(TINY_CONFIG, hidden_size=256, intermediate_size=256, num_hidden_layers=1, vocab_size=60000)
    spec = tmp_path / "config.json"
    spec.write_text(json.dumps(shape))
    out = tmp_path / "q4_k.gguf"
    dummy_gguf.write(str(spec), "q4_k", out)
    file = GGUFFile(out, strings=("tokenizer.ggml.tokens",))
    kinds = {name: GGMLQuantizationType(t.tensor_type).name for name, t in file.tensors.items()}
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == "Q4_K" and kinds["output.weight"] == "Q6_K"
    tokens = file.field("tokenizer.ggml.tokens")
    assert len(tokens) == 60000 and tokens[-1] == "<|unused_10847|>"  # padded past the default model's 49,152


def test_refused_where_no_file_can_be_written(tmp_path):
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(dict(TINY_CONFIG, hidden_size=48)))
    with pytest.raises(DummyWeightsError, match="not whole q8_0 blocks of 32"):
        dummy_gguf.write(str(odd), "q8_0", tmp_path / "odd.gguf")
    with pytest.raises(DummyWeightsError, match="for llama configs, not qwen3"):
        dummy_gguf.write("qwen3-0.6b", "q8_0", tmp_path / "qwen.gguf")
    with pytest.raises(DummyWeightsError, match="not int8"):
        dummy_gguf.write("llama-2-7b", "int8", tmp_path / "int8.gguf")


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_tensor_copied_out_no_longer_counts_in_memory(tmp_path):
    """A load reads each GGUF tensor once: release() unmaps its pages (reading it again still works)."""
    spec = tmp_path / "config.json"
    spec.write_text(json.dumps(dict(TINY_CONFIG, vocab_size=32000)))
    path = tmp_path / "m.gguf"
    dummy_gguf.write(str(spec), "q8_0", path)
    file = GGUFFile(path)
    embed = file.tensors["token_embd.weight"]  # 32,000 x 64 values: 2.1 MiB
    total = int(embed.data.sum())
    before = _mapped_kib(path)
    file.release(embed)
    after = _mapped_kib(path)
    assert before - after >= embed.data.nbytes // 1024 - 8, (before, after)
    assert int(embed.data.sum()) == total
