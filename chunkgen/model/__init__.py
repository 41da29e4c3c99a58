from chunkgen.model.llama import LlamaModel, UnsupportedModel
from chunkgen.model.loading import (
    ModelNotFound,
    check_model_dir,
    display_name,
    load_hf,
    parse_dtype,
    resolve_model,
    stale_copies,
)

__all__ = [
    "LlamaModel",
    "ModelNotFound",
    "check_model_dir",
    "display_name",
    "stale_copies",
    "UnsupportedModel",
    "load_hf",
    "parse_dtype",
    "resolve_model",
]
