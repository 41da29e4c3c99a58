from chunkgen.model.llama import LlamaModel, UnsupportedModel
from chunkgen.model.loading import ModelNotFound, load_hf, parse_dtype, resolve_model

__all__ = ["LlamaModel", "ModelNotFound", "UnsupportedModel", "load_hf", "parse_dtype", "resolve_model"]
