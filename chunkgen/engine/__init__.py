"""Turns the cache, the kernels and the model into answers."""

from chunkgen.engine.engine import Engine, EngineStats
from chunkgen.engine.params import ParamError, SamplingParams
from chunkgen.engine.sequence import Completion, Request, Result

__all__ = ["Completion", "Engine", "EngineStats", "ParamError", "Request", "Result", "SamplingParams"]
