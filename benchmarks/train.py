"""Training speed and quality of a preset, read back from the run's own TensorBoard file.

Usage:
    python -m benchmarks.train --input tinyshakespeare/input.txt     # quickstart settings, CPU
    python -m benchmarks.train --config config/baby_gpt.toml         # on a GPU: bf16, compiled
    python -m benchmarks.train --config config/gpt2_small.toml --max-iters 200 --no-compile

Trains the preset (by default config/quickstart.toml: 4 layers, 4 heads, 128 wide, block 64,
batch 12, 2000 iterations) into a temporary folder, on the text of --input (prepared
char-level there) or else on the preset's own data_dir. Then prints median ms/iter and
tokens/s, median MFU, the wall time of the whole run (evaluations included), the final val
loss and peak memory: allocated tensors on CUDA, the process's resident size on the CPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.prepare import prepare
from data.sources import read_text
from perf import memory_mb, reset_peak_memory
from train import resolve_device, resolve_dtype, train
from train_config import load_config

QUICKSTART = Path("config/quickstart.toml")


def main(
    config: Annotated[Path, typer.Option(help="Preset to train.")] = QUICKSTART,
    input: Annotated[Optional[Path], typer.Option(
        help="Train on this text (char-level) instead of the preset's data_dir.")] = None,
    max_iters: Annotated[Optional[int], typer.Option(help="Override the preset's.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Override the preset's.")] = None,
    device: Annotated[Optional[str], typer.Option(help="Override the preset's.")] = None,
    compile: Annotated[Optional[bool], typer.Option(
        "--compile/--no-compile", help="Override the preset's.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write figures here.")] = None,
) -> None:
    """Train a preset and print its speed, MFU, memory and final loss."""
    overrides = {"max_iters": max_iters, "dtype": dtype, "device": device, "compile": compile}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    with tempfile.TemporaryDirectory() as tmp:
        if input is not None:
            overrides["data_dir"] = str(Path(tmp) / "data")
            prepare(read_text(input), "char", overrides["data_dir"], source=str(input))
        cfg = load_config(config, {**overrides, "out_dir": tmp, "run_name": "bench",
                                   "sample_tokens": 0})
        run_device = resolve_device(cfg.device)
        reset_peak_memory(run_device)
        result = train(cfg)
        memory = memory_mb(run_device)
        acc = EventAccumulator(str(result.run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps
        tok_s = [e.value for e in acc.Scalars("perf/tokens_per_sec")]
        mfu = [e.value for e in acc.Scalars("perf/mfu")]
        val = acc.Scalars("loss/val")[-1]
    figures = {
        "config": config.name,
        "device": str(run_device),
        "dtype": str(resolve_dtype(cfg.dtype, run_device)).removeprefix("torch."),
        "compile": cfg.compile,
        "iters": result.iter_num,
        "median_ms_per_iter": 1000 * tokens_per_iter / statistics.median(tok_s),
        "median_tokens_per_s": statistics.median(tok_s),
        "median_mfu": statistics.median(mfu),
        "wall_time_s": result.wall_time,
        "val_loss": val.value,
        "val_loss_step": val.step,
        "peak_memory_mb": memory[1] if memory else None,
    }
    for key, value in figures.items():
        print(f"{key:>20}: {value:.4g}" if isinstance(value, float) else f"{key:>20}: {value}")
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
