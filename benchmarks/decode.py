"""Decoding speed of every path on a random-weight model shape: the same measurement as
`python sample.py --benchmark --preset`, with the knobs a study needs (--prompt-len,
--no-baselines). What each row means: measure/decoding.py.

Usage:
    python -m benchmarks.decode --preset gpt2 --lengths 64
    python -m benchmarks.decode --preset baby_gpt --prompt-len 512 --no-baselines
"""

from __future__ import annotations

from pathlib import Path

import typer

from measure.decoding import PROMPT_LEN, parse_lengths, run_benchmark


def main(preset: str = "baby_gpt", device: str = "cpu", dtype: str = "float32",
         lengths: str = "64,248,1024", repeats: int = 3, json: Path | None = None,
         decode: str = "auto", batch: int = 1, layout: str = "gpt2", n_kv_head: int = 0,
         baselines: bool = True, prompt_len: int = PROMPT_LEN) -> None:
    """Benchmark a random-weight model shape (see model.PRESETS and model.LAYOUTS)."""
    try:
        counts = parse_lengths(lengths)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_benchmark(None, preset, device, dtype, counts, repeats, json, decode, batch, layout,
                  n_kv_head, baselines, prompt_len)


if __name__ == "__main__":
    typer.run(main)
