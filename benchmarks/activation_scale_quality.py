"""Perplexity of the default model with int8 activations scaled per block of 32 values (what the
quantized products do) against one scale per row (what would let `--quantize int8` sum a whole row
in int32), both on per-channel int8 weights, fake-quantized in float64 through transformers'
forward; beside it the int8 kernel itself (tests/model/test_quant.py's swap). The first 512 tokens
of two shipped templates; prints each perplexity as a ratio to fp32.

    PYTHONPATH=. python benchmarks/activation_scale_quality.py  # from the repository root
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from chunkgen.model import quant, resolve_model
from chunkgen.model.loading import float_weights, load_tokenizer
from tests.helpers import PROMPTS
from tests.model.test_quant import _perplexity, _swap_linears

TEXTS = ("document_qa", "tool_dispatcher")
TOKENS = 512


def fake_int8(hf: torch.nn.Module, per_row: bool) -> None:
    """Every linear layer as per-channel int8 weights times x rounded to int8 per row or per 32."""
    for module in hf.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        w = module.weight.detach().double()
        w_scale = w.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
        w_q = (w / w_scale).round().clamp(-127, 127)

        def forward(x, w_q=w_q, w_scale=w_scale, bias=module.bias):
            shape = x.shape
            x = x.reshape(-1, shape[-1]).double()
            if per_row:
                x_scale = x.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
                x = (x / x_scale).round() * x_scale
            else:
                blocks = x.view(x.shape[0], -1, 32)
                x_scale = blocks.abs().amax(2, keepdim=True).clamp_min(1e-30) / 127
                x = ((blocks / x_scale).round() * x_scale).view_as(x)
            y = ((x @ w_q.T) * w_scale.T).float()
            return (y if bias is None else y + bias).reshape(*shape[:-1], -1)

        module.forward = forward


def main() -> None:
    folder = float_weights(resolve_model(None))
    tokenizer = load_tokenizer(folder)

    def fresh():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    for name in TEXTS:
        ids = torch.tensor(tokenizer((PROMPTS / f"{name}.toml").read_text())["input_ids"][:TOKENS])
        base = _perplexity(fresh(), ids)
        hf = fresh()
        _swap_linears(hf, quant.int8_source)
        kernel = _perplexity(hf, ids)
        ratios = {}
        for per_row in (False, True):
            hf = fresh()
            fake_int8(hf, per_row)
            ratios[per_row] = _perplexity(hf, ids) / base
        print(
            f"{name} ({len(ids)} tokens): fp32 {base:.4f}; int8 kernel (x per 32) {kernel / base:.4f}x, "
            f"fake x per 32 {ratios[False]:.4f}x, fake x per row {ratios[True]:.4f}x"
        )


if __name__ == "__main__":
    main()
