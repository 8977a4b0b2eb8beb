"""Training speed and quality on a text file, with the settings of the quickstart preset.

Usage:
    python -m benchmarks.train --input path/to/input.txt [--json train.json] [-- override=...]

Prepares the text char-level into a temporary folder, trains config/quickstart.toml on it
(4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 iterations, eval 20 batches every
250), then reads the run's TensorBoard file back and prints median ms/iter, MFU against
this machine's measured matmul peak, wall time, the final val loss and peak memory.
"""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
from pathlib import Path

import typer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.prepare import prepare
from data.sources import read_text
from train import train
from train_config import load_config

PRESET = Path(__file__).resolve().parent.parent / "config" / "quickstart.toml"


def main(input: Path, json_path: Path = typer.Option(None, "--json"),
         max_iters: int = 2000, dtype: str = "float32") -> None:
    """Train the quickstart preset on INPUT and print the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(read_text(input), "char", data_dir, source=str(input))
        cfg = load_config(PRESET, {"data_dir": str(data_dir), "out_dir": tmp, "run_name": "bench",
                                   "max_iters": max_iters, "dtype": dtype, "sample_tokens": 0})
        result = train(cfg)
        acc = EventAccumulator(str(result.run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
        tok_s = [e.value for e in acc.Scalars("perf/tokens_per_sec")]
        mfu = [e.value for e in acc.Scalars("perf/mfu")]
        val = acc.Scalars("loss/val")[-1]
    figures = {
        "median_ms_per_iter": 1000 * tokens_per_iter / statistics.median(tok_s),
        "median_tokens_per_s": statistics.median(tok_s),
        "median_mfu": statistics.median(mfu),
        "wall_time_s": result.wall_time,
        "val_loss": val.value,
        "val_loss_step": val.step,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    for key, value in figures.items():
        print(f"{key:>20}: {value:.4g}")
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
