"""Decoding speed of every path on a random-weight model shape: the same measurement as
`python sample.py --benchmark --preset`, with the knobs a study needs (--prompt-len,
--no-baselines). measure/decoding.py says what each row means.

Usage:
    python -m benchmarks.decode --preset gpt2 --lengths 64
    python -m benchmarks.decode --preset baby_gpt --prompt-len 512 --no-baselines
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from benchmarks import check_paths
from machine.errors import reported, run_command
from measure.decoding import PROMPT_LEN, parse_lengths, run_benchmark


def main(preset: str = "baby_gpt", device: str = "cpu", dtype: str = "float32",
         lengths: str = "64,248,1024", repeats: Annotated[int, typer.Option(min=1)] = 3,
         json: Path | None = None, decode: str = "auto",
         batch: Annotated[int, typer.Option(min=1)] = 1, layout: str = "gpt2",
         n_kv_head: Annotated[int, typer.Option(min=0)] = 0, baselines: bool = True,
         prompt_len: Annotated[int, typer.Option(min=1)] = PROMPT_LEN) -> None:
    """Benchmark a random-weight model shape (measure/decoding.py's PRESETS and LAYOUTS)."""
    with reported():  # a bad shape, length, path or device
        check_paths(json_path=json)
        run_benchmark(None, preset, device, dtype, parse_lengths(lengths), repeats, json,
                      decode, batch, layout, n_kv_head, baselines, prompt_len)


if __name__ == "__main__":
    run_command(main)
