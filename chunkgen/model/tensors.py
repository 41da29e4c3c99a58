"""A checkpoint's float tensors by their transformers names, read one at a time.

The loads that never build a whole float model (model/skeleton.py) read here what they make in
floats (norms, biases, a float embedding) and what `--quantize int8` quantizes: from a folder's
safetensors files (mapped; a tensor, or some of its rows, read when asked) or from a GGUF file
(the one tensor dequantized, named and fixed up as transformers' own whole-file conversion does:
its name map from the model's module tree, its per-architecture processor, e.g. Gemma's norms
stored as 1 + w).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class FolderTensors:
    """The tensors of a folder's *.safetensors files. Each read opens its file anew and closes it
    after: safetensors maps the whole file, and the pages a read touches count in the process's
    resident memory for as long as the mapping lives (for an 8B checkpoint, the whole file by the
    end of a load that kept it open)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), file))

    def _read(self, name: str, read):
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return read(f)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read(name, lambda f: f.get_slice(name).get_shape()))

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, lambda f: f.get_tensor(name))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a 2-D tensor, read alone."""
        return self._read(name, lambda f: f.get_slice(name)[start:stop])


class GGUFTensors:
    """The tensors of a GGUF file by the names transformers gives them in `model` (its module tree;
    parameters on the meta device will do): `names` is gguf's name map of the architecture
    (gguf.get_tensor_name_map), the values as transformers' tensor processor of the architecture
    makes them. (transformers' own get_gguf_hf_weights_map builds gguf's name map anew for every
    submodule it recurses into: 28 s for the default model's 400 modules.)"""

    def __init__(self, tensors: dict, arch: str, names, config, model) -> None:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        self.by_name = {}
        for hf_name, _ in model.named_parameters(remove_duplicate=False):
            module, _, suffix = hf_name.rpartition(".")
            key = names.get_name(module)
            if key is not None and f"{key}.{suffix}" in tensors:
                self.by_name[hf_name] = tensors[f"{key}.{suffix}"]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.by_name[name].shape))  # ggml lists the fastest dim first

    def get(self, name: str) -> torch.Tensor:
        from gguf import dequantize

        tensor = self.by_name[name]
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = self.processor.process(weights=weights, name=tensor.name).weights
        # a copy: an F32 tensor's values are a view of the mapped file
        return torch.from_numpy(np.array(weights, dtype=np.float32)).reshape(self.shape(name))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[start:stop]
