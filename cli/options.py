"""The command-line options that sample.py, serve.py and evaluate.py share, each declared once.

Usage:
    from cli.options import DeviceOption, RunOption
    def main(run: RunOption = None, device: DeviceOption = "cpu") -> None: ...

Each is a typer `Annotated` alias: the option's type and its help, which `--help` prints.
A command gives the default, as the function default of its parameter. check_output_file
refuses an output file (--json) that could not be written, before the work that fills it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from generate import DECODE_BACKENDS
from machine.errors import UserError

RunOption = Annotated[str | None, typer.Option(
        help="Run folder, or run name under runs/, whose best.pt (else last.pt) to load; "
             "default: the newest run.")]
CheckpointOption = Annotated[str | None, typer.Option(help="Checkpoint file to load.")]
InitFromOption = Annotated[str | None, typer.Option(
        help="Load a Hugging Face GPT-2 or NanoChat folder (config.json, weights, "
             "tokenizer.json), or a Hub id such as gpt2, instead.")]
TemperatureOption = Annotated[float, typer.Option(
        help="Softmax temperature; 0 is greedy (always the likeliest token). In serve.py, for "
             "requests that name none.")]
TopKOption = Annotated[int | None, typer.Option(
        help="Sample among the k likeliest tokens only. In serve.py, for requests that name none.")]
TopPOption = Annotated[float | None, typer.Option(
        help="Sample among the likeliest tokens whose probability adds up to p, in (0, 1]. In "
             "serve.py, for requests that name none.")]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or mps.")]
DtypeOption = Annotated[str, typer.Option(
        help="Weights dtype: float32, bfloat16, float16, or int8 (weight-only: int8 matrices "
             "with a scale per row, float activations; see weights/quantize.py).")]
BACKENDS = [f"{name} ({what})" for name, what in DECODE_BACKENDS.items()]
DecodeOption = Annotated[str, typer.Option(
        help=f"The cached decode step: {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}.")]
DebugOption = Annotated[bool, typer.Option(help="Show tracebacks for input errors.")]


class OutputError(UserError):
    """An output path that cannot be written; the message names the option and the fix."""


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file that cannot be written, before the work that fills it, because
    a benchmark or an evaluation must not run for minutes and then lose its figures."""
    if path.is_dir():
        raise OutputError(f"{option} {path} is a folder; give a file name")
    if not (path.parent.is_dir() and os.access(path.parent, os.W_OK)):
        raise OutputError(f"{option} {path}: {path.parent} is not a folder this process can "
                          f"write to; choose another path")
