from chunkgen.model.llama import LlamaModel, UnsupportedModel
from chunkgen.model.loading import ModelNotFound, check_model_dir, load_hf, parse_dtype, resolve_model

__all__ = ["LlamaModel", "ModelNotFound", "check_model_dir", "UnsupportedModel", "load_hf", "parse_dtype", "resolve_model"]
