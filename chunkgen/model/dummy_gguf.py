"""A GGUF file of random quantized weights in a config's shapes, so that llama.cpp and chunkgen can
be timed on the very same weights of a model that is not at hand (`chunkgen bench e2e
--dummy-weights llama-2-7b --quantize q4_k --systems chunkgen,llama_cpp`).

Only the llama architecture is written (Llama 2/3 and SmolLM2 shapes): its metadata and tensor
names are what llama.cpp's converter writes for them. The linear weights are drawn as blocks of the
asked type (quant.random_gguf: of the order of an initialised model's weights), the output layer
in Q6_K when the type is Q4_K, as a Q4_K_M file has it; the norms are ones. Rope scaling is not
written (it changes the rotary tables, not the cost). The tokenizer is the default model's, its
vocabulary cut or padded to the config's size (cut: with the merges that made a dropped token;
padded: with tokens no merge reaches), so that both engines load a complete file; the bench gives
prompts as token ids anyway.

The file is written one tensor at a time (the header first, then each tensor's bytes as they are
drawn), so a 7B shape never sits in memory whole.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from chunkgen.model.dummy import SHIPPED, DummyWeightsError, config_path, load_config

WEIGHT_SCALE = 0.02  # transformers' initializer_range for these models
ARCHITECTURES = ("llama",)


def output_type(qtype_name: str) -> str:
    """The output layer's type beside linear layers of qtype_name (Q4_K_M's mix for q4_k)."""
    return "q6_k" if qtype_name == "q4_k" else qtype_name


def cached_path(spec: str, qtype_name: str, seed: int) -> Path:
    """Where the file for (config, type, seed) is kept: under chunkgen's cache, named by the
    config's contents, so an edited config.json gets a file of its own."""
    from chunkgen.model.loading import cache_root

    digest = hashlib.sha256(config_path(spec).read_bytes()).hexdigest()[:12]
    return cache_root() / "dummy-gguf" / f"{_label(spec)}-{digest}-{qtype_name}-seed{seed}.gguf"


def _label(spec: str) -> str:
    """A shipped config's name, or a config file's stem."""
    return str(spec) if str(spec) in SHIPPED else Path(str(spec)).stem


def ensure(spec: str, qtype_name: str, seed: int = 0) -> tuple[Path, bool]:
    """The cached file for (config, type, seed), written first when missing; returns it and whether
    it was written now."""
    path = cached_path(spec, qtype_name, seed)
    if path.is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial-{os.getpid()}")
    try:
        write(spec, qtype_name, partial, seed)
        partial.replace(path)  # whole or absent: a run stopped while writing leaves no file behind
    finally:
        partial.unlink(missing_ok=True)
    return path, True


def write(spec: str, qtype_name: str, path: Path, seed: int = 0) -> None:
    """Write the GGUF of `spec` (a shipped config name or a config.json) with linear weights of
    qtype_name (a key of quant.GGUF_TYPES) drawn from `seed`."""
    import gguf

    from chunkgen.model.quant import GGUF_TYPES, random_gguf

    if qtype_name not in GGUF_TYPES:
        raise DummyWeightsError(f"a GGUF file holds {', '.join(GGUF_TYPES)} weights, not {qtype_name}")
    config = load_config(spec)
    if config.model_type not in ARCHITECTURES:
        raise DummyWeightsError(
            f"--dummy-weights {spec}: a GGUF file is written for {', '.join(ARCHITECTURES)} configs, "
            f"not {config.model_type}"
        )
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    ffn, vocab = config.intermediate_size, config.vocab_size
    qtype, out_qtype = GGUF_TYPES[qtype_name], GGUF_TYPES[output_type(qtype_name)]
    tied = bool(getattr(config, "tie_word_embeddings", False))

    # (name, rows, row length, type or None for an fp32 vector of ones), in llama.cpp's order
    tensors: list[tuple[str, int, int, object]] = [("token_embd.weight", vocab, hidden, qtype)]
    for i in range(layers):
        b = f"blk.{i}"
        tensors += [
            (f"{b}.attn_norm.weight", 1, hidden, None),
            (f"{b}.attn_q.weight", heads * head_dim, hidden, qtype),
            (f"{b}.attn_k.weight", kv_heads * head_dim, hidden, qtype),
            (f"{b}.attn_v.weight", kv_heads * head_dim, hidden, qtype),
            (f"{b}.attn_output.weight", hidden, heads * head_dim, qtype),
            (f"{b}.ffn_norm.weight", 1, hidden, None),
            (f"{b}.ffn_gate.weight", ffn, hidden, qtype),
            (f"{b}.ffn_up.weight", ffn, hidden, qtype),
            (f"{b}.ffn_down.weight", hidden, ffn, qtype),
        ]
    tensors.append(("output_norm.weight", 1, hidden, None))
    if not tied:
        tensors.append(("output.weight", vocab, hidden, out_qtype))
    for name, _, k, t in tensors:
        block = gguf.GGML_QUANT_SIZES[t][0] if t is not None else 1
        if k % block:
            raise DummyWeightsError(f"{name}: rows of {k} values are not whole {qtype_name} blocks of {block}")

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random {_label(spec)} ({qtype_name})")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(vocab)
    writer.add_file_type(_file_type(qtype_name))
    _add_tokenizer(writer, vocab)
    for name, n, k, t in tensors:
        if t is None:
            writer.add_tensor_info(name, (k,), np.dtype(np.float32), 4 * k)
        else:
            size = gguf.GGML_QUANT_SIZES[t]
            writer.add_tensor_info(name, (n, k // size[0] * size[1]), np.dtype(np.uint8), n * k // size[0] * size[1], t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, n, k, t in tensors:
        data = np.ones(k, dtype=np.float32) if t is None else random_gguf(t, n, k, WEIGHT_SCALE, rng)
        writer.write_tensor_data(data)
    writer.close()


def _file_type(qtype_name: str):
    """The file type llama.cpp's quantizer writes for this mix (q4_k: Q4_K_M, output in Q6_K)."""
    import gguf

    return {
        "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
        "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_M,
        "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
    }[qtype_name]


def _add_tokenizer(writer, vocab: int) -> None:
    """The default model's BPE tokenizer, its vocabulary cut or padded to `vocab` ids."""
    from chunkgen.model.gguf_file import GGUFFile
    from chunkgen.model.loading import default_gguf

    source = GGUFFile(default_gguf(), strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokens = [str(t) for t in source.field("tokenizer.ggml.tokens")]
    types = [int(t) for t in source.field("tokenizer.ggml.token_type")]
    merges = [str(m) for m in source.field("tokenizer.ggml.merges")]
    if vocab < len(tokens):
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        merges = [m for m in merges if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    else:
        pad = vocab - len(tokens)
        tokens += [f"<|unused_{i}|>" for i in range(pad)]
        types += [5] * pad  # llama.cpp's UNUSED
    writer.add_tokenizer_model(str(source.field("tokenizer.ggml.model")))
    writer.add_tokenizer_pre(str(source.field("tokenizer.ggml.pre")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
        ("tokenizer.ggml.unknown_token_id", writer.add_unk_token_id),
        ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id),
    ):
        value = int(source.field(key))
        if value < vocab:
            add(value)
    writer.add_add_bos_token(False)
    template = source.field("tokenizer.chat_template")
    if template:
        writer.add_chat_template(str(template))
