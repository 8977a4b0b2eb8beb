"""FSDP against DDP on CPU processes: the bytes each process holds and the step's time.

Usage:
    python -m benchmarks.fsdp                                  # the table in docs/distributed.md
    python -m benchmarks.fsdp --configs config/baby_gpt.toml --steps 5
    torchrun --standalone --nproc_per_node=2 -m benchmarks.fsdp --worker --parallel fsdp

Without --worker it runs each case as its own torchrun (gloo, one thread per process, on
random tokens) and prints one row per case:
- memory: GPT-2 small's shape (124M parameters, AdamW) on 1 process and on 2 under each
  parallel, with the bytes of weights, gradients and optimizer state that one process holds
  (its shards under FSDP), measured after a step, and the process's peak RSS;
- time: the median ms/iter of the presets given (their model, batch, block and optimizer)
  under DDP and FSDP on 2 processes.
The memory runs use block 256 and batch 1, because the weights, gradients and optimizer
state do not depend on them, and a step at GPT-2's 1024 takes long on a CPU.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from model import GPT
from training import distributed
from training.config import TrainConfig, load_config
from training.optimizer import configure_optimizers

REPO = Path(__file__).resolve().parent.parent


def local_bytes(tensors) -> int:
    """Bytes of this process's part of each tensor (its shard, if sharded)."""
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def worker(config: Path, parallel: str, steps: int, vocab_size: int, block_size: int | None,
           batch_size: int | None) -> dict:
    """One process's side of a case: build, step, measure; rank 0 returns the figures."""
    overrides = {"block_size": block_size, "batch_size": batch_size}
    # one micro-batch a process for each step, which the processes must divide among them
    accumulation = distributed.environment().world_size
    cfg = load_config(config, {"parallel": parallel, "dtype": "float32", "device": "cpu",
                               "gradient_accumulation_steps": accumulation,
                               **{key: value for key, value in overrides.items() if value}})
    with distributed.process_group(cfg) as info:
        return measure(cfg, info, config, parallel, steps, vocab_size)


def measure(cfg: TrainConfig, info: distributed.Dist, config: Path, parallel: str, steps: int,
            vocab_size: int) -> dict:
    """Build the case's model, take its steps, and return its figures."""
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    shape = cfg.model_config(vocab_size)
    if parallel == "fsdp" and info.enabled:
        from training.fsdp import shard_model
        model = shard_model(shape, device, None, compile=False)
        step_model: torch.nn.Module = model
    else:
        model = GPT(shape)
        step_model = torch.nn.parallel.DistributedDataParallel(model) if info.enabled else model
    optimizers = configure_optimizers(model, cfg, device)
    tokens = torch.randint(vocab_size, (cfg.batch_size, cfg.model.block_size + 1),
                           generator=torch.Generator().manual_seed(info.rank))
    times, grad_bytes = [], 0
    for _ in range(steps + 1):  # the first step builds the optimizer state, so it is not timed
        start = time.perf_counter()
        _, loss = step_model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grad_bytes = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
        distributed.whole(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    figures = {
        "config": config.stem, "parallel": parallel if info.enabled else "none",
        "processes": info.world_size, "params_m": model.num_params(non_embedding=False) / 1e6,
        "weights_mb": local_bytes(model.parameters()) / 1e6, "grads_mb": grad_bytes / 1e6,
        "optimizer_mb": local_bytes(t for opt in optimizers for state in opt.state.values()
                                    for t in state.values() if t.dim() > 0) / 1e6,
        "ms_per_iter": 1000 * statistics.median(times[1:]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }
    return figures


def run_case(processes: int, *args: str) -> dict:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={processes}"] if processes > 1 else [sys.executable])
    result = subprocess.run([*launcher, "-m", "benchmarks.fsdp", "--worker", *args], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"benchmark case {args} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(
    worker_: Annotated[bool, typer.Option("--worker", help="Run one case in this process.")] = False,
    config: Path = REPO / "config" / "gpt2_small.toml",
    parallel: str = "fsdp",
    steps: int = 3,
    vocab_size: int = 50257,
    block_size: Annotated[int | None, typer.Option(help="Default: the preset's.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Default: the preset's.")] = None,
    configs: Annotated[str, typer.Option(help="Presets whose step time to compare.")] =
        "config/quickstart.toml,config/baby_gpt.toml",
) -> None:
    if worker_:
        figures = worker(config, parallel, steps, vocab_size, block_size, batch_size)
        if distributed.environment().is_main:
            print(json.dumps(figures))
        return
    memory = ["--config", str(config), "--vocab-size", "50257", "--block-size", "256",
              "--batch-size", "1", "--steps", "1"]
    rows = [run_case(1, *memory, "--parallel", "ddp"),
            run_case(2, *memory, "--parallel", "ddp"),
            run_case(2, *memory, "--parallel", "fsdp")]
    rows += [run_case(2, "--config", preset, "--vocab-size", "65", "--parallel", kind,
                      "--steps", str(steps))
             for preset in configs.split(",") for kind in ("ddp", "fsdp")]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, one thread a process")
    print("| preset | parallel | processes | weights MB | grads MB | optimizer MB | "
          "ms/iter | peak RSS MB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['config']} | {r['parallel']} | {r['processes']} | {r['weights_mb']:.0f} | "
              f"{r['grads_mb']:.0f} | {r['optimizer_mb']:.0f} | {r['ms_per_iter']:.0f} | "
              f"{r['peak_rss_mb']:.0f} |")
    held = [r["weights_mb"] + r["grads_mb"] + r["optimizer_mb"] for r in (rows[0], rows[2])]
    print(f"fsdp on 2 processes holds {held[1] / held[0]:.2f}x of one process's weights, "
          f"gradients and optimizer state")


if __name__ == "__main__":
    typer.run(main)
