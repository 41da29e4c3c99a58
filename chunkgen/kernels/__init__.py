"""The kernels the model calls: decode attention over the prefix tree (decode.py), prefill attention
(prefill.py), the fused elementwise ops (elementwise.py), and a naive reference for the tests."""

from chunkgen.kernels.decode import decode_attention, decode_step_attention, workspace_for

__all__ = ["workspace_for", "decode_step_attention", "decode_attention"]
