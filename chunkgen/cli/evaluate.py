"""`chunkgen eval`: lm-evaluation-harness with the `chunkgen` model registered, taking lm_eval's
own arguments (--model chunkgen --model_args ... --tasks ... --include_path ... --num_fewshot ...
--batch_size ... --log_samples --output_path ...). Needs the `eval` extra (lm-eval)."""

from __future__ import annotations

import sys

import typer

from chunkgen.cli.boundary import app


@app.command(
    "eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def eval_command(ctx: typer.Context) -> None:
    """Run lm-evaluation-harness with the chunkgen backend: `chunkgen eval --model chunkgen
    --model_args dtype=fp32 --tasks TASK [lm_eval's other arguments]`."""
    try:
        from lm_eval._cli import HarnessCLI
    except ImportError:
        raise typer.BadParameter("needs lm-evaluation-harness: pip install 'chunkgen[eval]'") from None
    import chunkgen.evaluation.lm_eval_backend  # noqa: F401  # registers --model chunkgen

    args = list(ctx.args)
    if "--model" not in args and not any(a.startswith("--model=") for a in args) and "-h" not in args:
        args = ["--model", "chunkgen", *args]
    if "--device" not in args and not any(a.startswith("--device=") for a in args):
        args += ["--device", "auto"]  # lm_eval's default is cuda:0; chunkgen picks the GPU itself when there is one
    saved = sys.argv
    sys.argv = ["lm_eval", *args]
    try:
        parser = HarnessCLI()
        parser.execute(parser.parse_args())
    finally:
        sys.argv = saved
