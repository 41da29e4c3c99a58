"""Shared fixtures: a tiny random-weight Llama with a sentencepiece tokenizer trained on the
shipped prompts (built once per session), and the real default model for the few tests that need it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CHUNKGEN_CHECK_CONTEXT", "1")  # every kernel context is fully validated

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "prompts"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(out: Path) -> None:
    import sentencepiece as spm

    # Templates and queries, without the templates' [output] tables (constraints, schema files):
    # the tokenizer, and so every tiny-model output the tests compare, stays as it was before
    # templates had them.
    files = [f for f in sorted(PROMPTS.iterdir()) if f.suffix in (".toml", ".jsonl")]
    texts = [f.read_text().split("\n[output]")[0] for f in files]
    lines = [l for t in texts for l in t.splitlines() if l.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(out / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": True,
            }
        )
    )


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0))
    else:  # Qwen2: attention bias, tied embeddings, linear rope scaling
        model = Qwen2ForCausalLM(
            Qwen2Config(**common, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
        )
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen"), arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    from chunkgen.llm import LLM

    return LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=16)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from chunkgen.model import ModelNotFound, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFound as exc:  # the README's set-up (make test) installs it
        pytest.skip(f"real_model test skipped: {exc}")
