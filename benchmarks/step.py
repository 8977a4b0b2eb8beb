"""What each of the CPU step's speed-ups buys: the quickstart's training step timed with
them turned on one after another, each row in a process of its own, the rows taking turns.

Usage:
    python -m benchmarks.step                 # 3 rounds, random tokens, the quickstart's shape
    python -m benchmarks.step --rounds 5 --dtype float32

A row's time is the median of 40 steps (forward, backward, clipping, both optimizers) after
5 to warm up. The changes a row turns off are put back to what they replaced: the C kernels
to PyTorch's operations (machine/cpu_kernels.py's own fallback), Newton-Schulz to one matrix
at a time, glibc's memory thresholds to their defaults (a process that never calls
reuse_freed_memory), and the heap to 4 KB pages (reuse_freed_memory(huge_pages=False)).
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time
from typing import Annotated

import typer

from benchmarks.race import QUICKSTART, machine_line
from machine.errors import reported, run_command

# each row turns on one more change, on top of the rows before it
CHANGES = [
    ("before: a 4x MLP, PyTorch's operations, Newton-Schulz one matrix at a time, malloc's "
     "defaults", dict(n_inner=512, kernels=False, batched_ns=False, malloc=False, huge=False)),
    ("+ freed memory kept for reuse", dict(malloc=True)),
    ("+ Newton-Schulz on the matrices of one shape together", dict(batched_ns=True)),
    ("+ the C kernels (RMSNorm, relu^2, the rotary rotation)", dict(kernels=True)),
    ("+ an MLP 3x wide (n_inner = 384)", dict(n_inner=384)),
    ("+ an MLP 2x wide (n_inner = 256)", dict(n_inner=256)),
    ("+ the heap in 2 MB pages: the quickstart now", dict(huge=True)),
]
ROWS = list(zip([name for name, _ in CHANGES],
                itertools.accumulate((change for _, change in CHANGES), lambda a, b: {**a, **b}),
                strict=True))


def time_step(settings: dict, dtype: str) -> float:
    """The median ms of the quickstart's step with these settings, in this process."""
    import torch

    if settings["malloc"]:
        from machine.device import reuse_freed_memory
        reuse_freed_memory(huge_pages=settings["huge"])
    import machine.cpu_kernels
    import training.optimizer
    if not settings["kernels"]:
        machine.cpu_kernels.kernels = lambda: None
    if not settings["batched_ns"]:
        training.optimizer.by_shape = lambda matrices, blocks, fn: [
            fn(m, b) for m, b in zip(matrices, blocks, strict=True)]
    from model import GPT
    from training.config import load_config
    torch.manual_seed(0)
    cfg = load_config(QUICKSTART, {"n_inner": settings["n_inner"]})
    model = GPT(cfg.model_config(65))
    torch_dtype = getattr(torch, dtype)
    optimizers = training.optimizer.configure_optimizers(model, cfg, torch.device("cpu"), torch_dtype)
    autocast = torch.autocast("cpu", dtype=torch_dtype, enabled=torch_dtype != torch.float32)
    x, y = (torch.randint(0, 65, (cfg.batch_size, cfg.model.block_size)) for _ in range(2))

    def step() -> float:
        t0 = time.perf_counter()
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(5):
        step()
    return 1000 * statistics.median(step() for _ in range(40))


def main(
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of every row, taking turns.")] = 3,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    child: Annotated[str | None, typer.Option(hidden=True)] = None,
) -> None:
    """Time the quickstart's step with each speed-up turned on in turn."""
    if child is not None:  # one row, in a fresh process
        print(time_step(json.loads(child), dtype))
        return
    with reported():
        print(machine_line())
        times: dict[str, list[float]] = {name: [] for name, _ in ROWS}
        for _ in range(rounds):
            for name, settings in ROWS:
                out = subprocess.run([sys.executable, "-m", "benchmarks.step", "--dtype", dtype,
                                      "--child", json.dumps(settings)],
                                     capture_output=True, text=True, check=True)
                times[name].append(float(out.stdout.split()[-1]))
        base = statistics.median(times[ROWS[0][0]])
        print("| change | ms/step | the rounds | speed-up |")
        print("| --- | --- | --- | --- |")
        for name, _ in ROWS:
            median = statistics.median(times[name])
            print(f"| {name} | {median:.1f} | {' / '.join(f'{t:.1f}' for t in times[name])} | "
                  f"{base / median:.2f}x |")


if __name__ == "__main__":
    run_command(main)
