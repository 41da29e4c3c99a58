"""Tiny configs of every supported family, as transformers builds them (the model tests' shared
input): windows against a chunk of CHUNK tokens, rope scalings, fused and nested layouts."""

from __future__ import annotations

CHUNK = 16


def _common(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def family_config(family: str, vocab: int):
    import transformers as tf

    c = _common(vocab)
    if family == "qwen3":  # q/k norms, head_dim set apart from hidden / heads, tied embeddings
        return tf.Qwen3Config(**c, head_dim=32, tie_word_embeddings=True)
    if family == "qwen3-window":  # Qwen3 with sliding-window layers below max_window_layers
        return tf.Qwen3Config(
            **c,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=CHUNK,
            max_window_layers=2,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    if family == "phi3":  # fused qkv and gate_up, a window of several chunks, partial rotary (Phi-4)
        return tf.Phi3Config(
            **c,
            sliding_window=40,
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
            original_max_position_embeddings=4096,
        )
    if family == "mistral":  # every layer windowed, a window between chunk boundaries
        return tf.MistralConfig(**c, sliding_window=20, tie_word_embeddings=False)
    if family == "gemma2":  # soft-capped attention and logits, alternating windows smaller than a chunk
        return tf.Gemma2Config(
            **c,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=10,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if family == "gemma3":  # q/k norms, two rope bases, local layers of a window below a chunk
        return tf.Gemma3TextConfig(
            **c,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_local_base_freq=10_000.0,
            rope_theta=1_000_000.0,
        )
    if family == "gemma3-multimodal":  # a Gemma 3 4B-style checkpoint: the text model nested in text_config
        text = family_config("gemma3", vocab).to_dict()
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return tf.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            boi_token_index=vocab - 3,
            eoi_token_index=vocab - 2,
            image_token_index=vocab - 1,
        )
    if family == "llama3-rope":  # Llama 3.1/3.2 rope scaling, short original context so it matters
        return tf.LlamaConfig(
            **c,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10_000.0,
            },
        )
    if family == "qwen2-yarn":  # YaRN with its attention scaling
        return tf.Qwen2Config(
            **c,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10_000.0,
            },
        )
    if family == "phi3-longrope":  # Phi-3.5 / Phi-4-mini: longrope, frequencies chosen by length
        # as the checkpoints write it (every transformers release reads this; 4.x allows no more keys)
        return tf.Phi3Config(
            **c,
            tie_word_embeddings=False,
            original_max_position_embeddings=64,
            rope_theta=10_000.0,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            },
        )
    if family == "llama-dynamic":  # dynamic NTK scaling past the original context
        return tf.LlamaConfig(
            **c,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "dynamic",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10_000.0,
            },
        )
    raise ValueError(family)


FAMILIES = [
    "qwen3",
    "qwen3-window",
    "phi3",
    "mistral",
    "gemma2",
    "gemma3",
    "gemma3-multimodal",
    "llama3-rope",
    "qwen2-yarn",
    "phi3-longrope",
    "llama-dynamic",
]
