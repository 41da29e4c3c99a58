"""Turns the cache, the kernels and the model into answers."""
from chunkgen.engine.engine import Engine, EngineConfig, EngineStats
from chunkgen.engine.sampler import ParamError, SamplingParams
from chunkgen.engine.sequence import Completion, Request, Result

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStats", "ParamError", "Request", "Result", "SamplingParams"]
