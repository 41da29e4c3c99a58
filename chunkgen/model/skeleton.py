"""A transformers model for quantized linear layers, whose float linear weights are never made.

The module tree is built with its parameters on the meta device (shapes only; buffers such as the
rotary tables are real), then every parameter the quantized source does not replace (norms, a float
embedding, a product the file holds in floats) is made one tensor at a time: read from the file the
source reads (a GGUF's tensor dequantized alone, a safetensors tensor through its mapping:
model/tensors.py) or drawn as transformers initialises it (--dummy-weights). The linear layers'
weights come from the source when LlamaModel builds each product (quant.quantized_linears): tensor
by tensor from the GGUF's mapped file, read and made int8, or drawn as blocks. So a load holds the
weights once, in the layouts the forward reads, never a whole float model. Every tensor is checked
against the config's shapes before anything is made (a file is data: its shapes are claims).
"""

from __future__ import annotations

from pathlib import Path

import torch

from chunkgen.model.folder import read_json


class SkeletonError(RuntimeError):
    """A parameter the model needs has no source (the message names it)."""


def skeleton(config, dtype: torch.dtype):
    """The transformers model of `config` in `dtype` with its parameters on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from chunkgen.model.loading import _quiet_transformers

    _quiet_transformers()
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _quantized(model, source) -> set[int]:
    """ids of the parameters the source replaces: the weights of the linear layers it holds, and
    the embedding's where it holds that too (a GGUF's quantized token embedding)."""
    taken = {
        id(m.weight) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and source.has(name, m)
    }
    has_embedding = getattr(source, "has_embedding", None)
    if has_embedding is not None and has_embedding():
        taken.add(id(model.get_input_embeddings().weight))
    return taken


def _fill(model, source, make) -> None:
    """Every parameter the source does not replace, made by `make(name, module, param)`, one at a
    time; the output layer re-tied to the embedding where the config ties them."""
    taken = _quantized(model, source)
    _check_products(model, source)
    for name, module in list(model.named_modules()):
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta" or id(param) in taken:
                continue
            full = f"{name}.{pname}" if name else pname
            setattr(module, pname, torch.nn.Parameter(make(full, module, param), requires_grad=False))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and head is not None and head.weight.device.type == "meta" and id(head.weight) not in taken:
        head.weight = embed.weight  # the float output layer is the float embedding
    # a parameter the source was to replace but will not: a file that lacks the tensor
    left = [
        n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta" and id(p) not in taken
    ]
    if left:
        raise SkeletonError(f"no weights for {', '.join(left[:4])}{' ...' if len(left) > 4 else ''}")


def _check_products(model, source) -> None:
    """Each product the source makes from a file has the shape the config gives its module."""
    shape = getattr(source, "shape", None)
    if shape is None:  # drawn to the module's shape
        return
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and source.has(name, m):
            found = tuple(shape(name))
            if found != tuple(m.weight.shape):
                raise SkeletonError(
                    f"{name}.weight is {_shape(found)} in the file, {_shape(m.weight.shape)} in the config"
                )


def _shape(shape) -> str:
    return " x ".join(str(d) for d in shape)


def from_folder(path: Path, config, dtype: torch.dtype, source):
    """The model of a folder with the parameters `source` replaces left unmade: the rest read
    tensor by tensor from the file the source reads (source.float_tensors: a GGUF, the folder's
    safetensors). The module tree is chunkgen's own where model/tree.py mirrors the family, so a
    run's load does not import transformers' modeling code."""
    from transformers import GenerationConfig

    from chunkgen.model.tree import module_tree

    model = module_tree(config, dtype) or skeleton(config, dtype)
    tensors = source.float_tensors(model)

    def read(name: str, module, param) -> torch.Tensor:
        if name not in tensors:
            raise SkeletonError(f"{path}: no tensor {name} in the weights")
        found = tensors.shape(name)
        if tuple(found) != tuple(param.shape):
            raise SkeletonError(f"{name} is {_shape(found)} in the weights, {_shape(param.shape)} in the config")
        return tensors.get(name).to(param.dtype)

    _fill(model, source, read)
    # Read as every other file of a folder is (bounded, checked), not through from_pretrained.
    saved = Path(path) / "generation_config.json"
    if saved.is_file():
        model.generation_config = GenerationConfig.from_dict(read_json(saved))
    else:  # none saved: the config's own
        model.generation_config = GenerationConfig.from_model_config(config)
    return model


def random(config, dtype: torch.dtype, source, seed: int = 0):
    """The model of `config` with every parameter the source does not replace drawn as
    transformers initialises it (normal(0, initializer_range), norms at 1), one tensor at a time."""
    from transformers import GenerationConfig

    model = skeleton(config, dtype)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:

        def draw(name: str, module, param) -> torch.Tensor:
            setattr(module, name.rsplit(".", 1)[-1], torch.nn.Parameter(torch.empty_like(param, device="cpu")))
            model._init_weights(module)  # every parameter of the module: each is drawn once, here
            return getattr(module, name.rsplit(".", 1)[-1]).detach()

        _fill(model, source, draw)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig.from_model_config(config)
    return model
