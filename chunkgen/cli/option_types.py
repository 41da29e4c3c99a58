"""The options several commands share, each declared once: the engine's (MODEL, DEVICE, DTYPE,
KV_MEMORY, MAX_BATCH, CHUNK_SIZE, as typer `Annotated` types whose defaults are config.py's) and the
sampling options, one per SamplingParams field (`sampling_options`). A command that means another
thing by a similar option gives it another name (`--kv-dtype` is the K/V dtype, `--dtype` the
model's)."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from chunkgen.cli.boundary import usage
from chunkgen.config import (
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_KV_MEMORY,
    DEFAULT_MAX_BATCH,
    DEFAULT_MIXED_PREFILL_TOKENS,
    DEFAULT_MODEL,
)
from chunkgen.engine.params import SAMPLING_FIELDS, SamplingParams


def max_batch_values(value: str) -> str:
    """Checks --max-batch (one value or several, comma-separated) while the options are parsed."""
    from chunkgen.device import choose_max_batch

    for part in value.split(","):
        try:
            choose_max_batch(part)
        except ValueError as exc:
            usage("--max-batch", str(exc))
    return value


MODEL = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="MODEL",
        help="A Hugging Face model directory, a .gguf file, or a repo id (org/name) in the local Hugging Face "
        "cache; never downloaded [default: the embedded SmolLM2-135M-Instruct].",
    ),
]
DEVICE = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help="auto, cpu, cuda or cuda:N; auto: the GPU when torch sees one and chunkgen's CUDA kernels are "
        "built, else the CPU.",
    ),
]
DTYPE = Annotated[
    str,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="Weights and activations: fp32, bf16 (fp16 on GPU) or auto: bf16 on a CPU with native bf16 "
        "arithmetic (AVX512_BF16 or AMX), fp32 on other CPUs, the model's own dtype on a GPU; the K/V cache "
        "keeps the same dtype (fp32 for an fp16 model on the CPU).",
    ),
]
QUANTIZE = Annotated[
    str,
    typer.Option(
        "--quantize",
        metavar="MODE",
        help="Linear weights on the CPU: auto (a GGUF file's own quantized types, as shipped: Q8_0, Q4_0, "
        "Q4_1, Q4_K, Q5_K, Q6_K, so the embedded model runs as its Q4_1 file; floats for other models; the "
        "default of run), none (floats in --dtype; the default of the benches), int8 (per-channel int8 made "
        "at load). With --dummy-weights also q8_0, q4_0, q4_1, q4_k, q5_k, q6_k. Activations are quantized "
        "per row to int8 blocks. On a GPU, GGUF weights run dequantized.",
    ),
]
DUMMY_WEIGHTS = Annotated[  # the benches': a model's shapes without its weights
    str | None,
    typer.Option(
        "--dummy-weights",
        metavar="CONFIG",
        help="Instead of --model: random weights (seeded) of the shapes in CONFIG, a shipped name "
        "(smollm2-135m, llama-3.2-1b, llama-2-7b, llama-3.1-8b, qwen3-0.6b, qwen3-4b, gemma-3-1b, phi-3-mini) or "
        "a Hugging Face config.json. Prompts are token ids; outputs are not meaningful, speed and memory are.",
    ),
]
KV_DTYPE = Annotated[
    str | None,
    typer.Option(
        "--kv-dtype",
        metavar="DTYPE",
        help="The K/V cache's dtype: fp32 or bf16 (fp16 too on a GPU) [default: --dtype's; fp32 for an fp16 "
        "model on the CPU]. bf16 halves the cache of an fp32 run (what a 7-8B model's cache needs to fit).",
    ),
]
KV_MEMORY = Annotated[
    str,
    typer.Option(
        "--kv-memory",
        metavar="SIZE",
        help="KV cache budget, e.g. 2GiB, or auto: on a GPU 85% of the memory the weights leave free "
        "(reserved at once), on the CPU 4GiB (used as chunks fill).",
    ),
]
MAX_BATCH = Annotated[
    str,
    typer.Option(
        "--max-batch",
        metavar="N",
        callback=max_batch_values,
        help="Sequences decoded together, or auto: as many as the KV budget holds, at most 256.",
    ),
]
MAX_BATCHES = Annotated[  # the benches' form: several values give a row each
    str,
    typer.Option(
        "--max-batch",
        metavar="N[,N...]",
        callback=max_batch_values,
        help="Sequences decoded together: a number or auto (as for run); several, comma-separated, give a row each.",
    ),
]
CHUNK_SIZE = Annotated[int, typer.Option("--chunk-size", metavar="N", help="Tokens per KV chunk (a multiple of 16).")]
BATCH_INVARIANT = Annotated[
    str,
    typer.Option(
        "--batch-invariant",
        metavar="auto|on|off",
        help="on: a row's answer and logprobs do not depend on the rows run beside it (--max-batch, --resume, "
        "--shard, a warm cache); off: each kernel call's own fastest plan, answers may differ near ties (on the "
        "CPUs measured no faster end to end; on a GPU not yet measured); auto: on, except on a GPU "
        "(docs/batch-invariance.md).",
    ),
]
MIXED_PREFILL_TOKENS = Annotated[
    int,
    typer.Option(
        "--mixed-prefill-tokens",
        metavar="N",
        min=0,
        help="On the CPU, rows admitted while others decode run in the same forward as the decode step (rows join a "
        "step until their new prompt tokens reach N), so running rows do not wait for them; 0: a prefill wave runs alone.",
    ),
]

# The defaults of the types above, by option: every command that takes one of these options
# declares it with its type and this default (tests/cli/test_option_types.py checks every command).
ENGINE_DEFAULTS = {
    "--model": DEFAULT_MODEL,
    "--device": DEFAULT_DEVICE,
    "--dtype": DEFAULT_DTYPE,
    "--kv-memory": DEFAULT_KV_MEMORY,
    "--max-batch": DEFAULT_MAX_BATCH,
    "--chunk-size": DEFAULT_CHUNK_SIZE,
    "--batch-invariant": DEFAULT_BATCH_INVARIANT,
    "--mixed-prefill-tokens": DEFAULT_MIXED_PREFILL_TOKENS,
}


# -- sampling options -------------------------------------------------------------------------------
def flag(name: str) -> str:
    """A SamplingParams field's command-line option: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


SAMPLING_OPTIONS = {f.name: flag(f.name) for f in SAMPLING_FIELDS}  # field -> option


def _cli_type(f) -> Any:
    """The type typer parses a field's option as: a file's path, a repeatable list, or the field's
    own scalar type, always Optional (None: not given, so the template's or chunkgen's default)."""
    if f.metadata["file"]:
        return Path | None
    hint = typing.get_type_hints(SamplingParams)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return list[args[0]] | None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = args[0]
    return hint | None


def _help(f) -> str:
    shown = f.metadata["shown"]
    if shown is None:
        shown = str(f.default).lower() if isinstance(f.default, bool) else f"{f.default:g}"
    return f"{f.metadata['help']} [default: {shown}]"


def _parameter(f) -> inspect.Parameter:
    cli_type = _cli_type(f)
    if cli_type == bool | None:
        option = typer.Option(flag(f.name), help=_help(f))
    else:
        option = typer.Option(flag(f.name), metavar=f.metadata["metavar"], help=_help(f))
    return inspect.Parameter(
        f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[cli_type, option]
    )


def sampling_options(command: Callable) -> Callable:
    """Puts one option per SamplingParams field where `command` has its `sampling` parameter, and
    calls it with `sampling`: the options given, by field (lists as given; files as paths)."""
    signature = inspect.signature(command, eval_str=True)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("sampling")
    added = [_parameter(f) for f in SAMPLING_FIELDS]
    names = {p.name for p in added}
    clash = names & {p.name for p in params}
    if clash:
        raise TypeError(f"{command.__name__} already has parameters {sorted(clash)}")
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
    new_params = params[:at] + added + params[at + 1 :]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in names}
        return command(**kwargs, sampling={k: v for k, v in given.items() if v not in (None, [])})

    wrapper.__signature__ = signature.replace(parameters=new_params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in new_params}
    del wrapper.__wrapped__  # typer reads the signature above, not the command's own
    return wrapper
