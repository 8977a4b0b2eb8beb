"""What a process needs to train and save, under DDP and FSDP: train.py itself, with its
checkpoints, on CPU processes (gloo, one thread each).

Usage:
    python -m benchmarks.sharded                      # both tables in docs/distributed.md
    python -m benchmarks.sharded --limit-gb 2.0 --layers 1,24

It prints:
- the peak RSS of each process of one run (the largest of them), for the same model on 1
  process and on 2 and 4 under FSDP (2 under DDP too), each running one iteration and saving
  its checkpoint (whole under DDP, each process its shards under FSDP), then resuming from it;
- the largest model (n_embd 1024 and n_layer layers, AdamW) that trains one iteration,
  saves and resumes with every process under `ulimit -v`, by bisection over n_layer, under
  DDP and FSDP on 2 processes.
glibc's malloc is told to keep its address space small (as tests/test_distributed.py does),
or ulimit -v would count the arenas of gloo's threads rather than the model. The data is
the built-in Shakespeare characters (prepared at first use).
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

REPO = Path(__file__).resolve().parent.parent
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}


def train(out: Path, nproc: int, parallel: str, n_layer: int, max_iters: int,
          resume: bool = False, limit_gb: float | None = None) -> tuple[bool, float, str]:
    """One train.py run: whether it finished, the largest peak RSS (MB) of its training
    processes, and its last error line."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable])
    args = [str(REPO / "train.py"), "--config", str(REPO / "config" / "tiny.toml"),
            "--out-dir", str(out), "--n-layer", str(n_layer), "--n-embd", "1024",
            "--n-head", "8", "--batch-size", "2", "--gradient-accumulation-steps", "4",
            "--eval-interval", "1", "--eval-iters", "4", "--sample-tokens", "0",
            "--max-iters", str(max_iters), *(["--parallel", parallel] if nproc > 1 else []),
            *(["--resume"] if resume else [])]
    limit = int(limit_gb * 1e9) if limit_gb else None
    proc = subprocess.Popen([*launcher, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV},
                            preexec_fn=limit and (lambda: resource.setrlimit(
                                resource.RLIMIT_AS, (limit, limit))))
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    peaks: dict[int, int] = {}
    while proc.poll() is None:  # VmHWM only grows, so its last reading is the peak
        for pid in workers(proc.pid, nproc):
            peaks[pid] = max(peaks.get(pid, 0), high_water_kb(pid))
        time.sleep(0.02)
    errors = [line.strip() for line in stderr if line.startswith("error: ")]
    return proc.returncode == 0, max(peaks.values(), default=0) / 1024, (errors or [""])[-1]


def workers(pid: int, nproc: int) -> list[int]:
    """The training processes: torchrun's children, or the plain process itself."""
    if nproc == 1:
        return [pid]
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def high_water_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmHWM:\s+(\d+)", status)
    return int(found[1]) if found else 0


def trains_and_resumes(nproc: int, parallel: str, n_layer: int, limit_gb: float | None,
                       ) -> tuple[bool, float, str]:
    """Train one iteration and save it, then one more resumed from it; return (whether both
    finished, the larger peak RSS of the two runs, the error if not)."""
    with tempfile.TemporaryDirectory() as out:
        done, peak, error = train(Path(out), nproc, parallel, n_layer, 1, limit_gb=limit_gb)
        if not done:
            return False, peak, error
        done, resumed_peak, error = train(Path(out), nproc, parallel, n_layer, 2, resume=True,
                                          limit_gb=limit_gb)
        return done, max(peak, resumed_peak), error


def reason(error: str) -> str:
    """What stopped a run, in a few words."""
    if error.startswith("error: this run needs at least"):
        return "refused by the memory check"
    if "ran out of memory" in error:
        return error.removeprefix("error: ").split(" ran out of memory")[0] + " ran out of memory"
    return error or "failed without a message"


def largest(parallel: str, low: int, high: int, limit_gb: float) -> tuple[int, str]:
    """The most layers (between low and high) that train, save and resume on 2 processes
    under the limit, and why one more did not."""
    best, why = 0, ""
    while low <= high:
        mid = (low + high) // 2
        done, _, error = trains_and_resumes(2, parallel, mid, limit_gb)
        print(f"  {parallel} n_layer {mid}: {'fits' if done else reason(error)}", flush=True)
        if done:
            best, low = mid, mid + 1
        else:
            why, high = reason(error), mid - 1
    return best, why


def params_m(n_layer: int) -> float:
    """The model's parameters, in millions (vocabulary 65, block 32)."""
    return (n_layer * (12 * 1024**2 + 13 * 1024) + 65 * 1024 + 32 * 1024 + 2 * 1024) / 1e6


def main(layers_rss: Annotated[int, typer.Option(help="n_layer of the RSS runs.")] = 6,
         limit_gb: Annotated[float, typer.Option(help="Each process's ulimit -v.")] = 2.0,
         layers: Annotated[str, typer.Option(help="The n_layer range to search.")] = "1,24",
         ) -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, one thread a process")
    print(f"\npeak RSS of the largest process, n_layer {layers_rss} x n_embd 1024 "
          f"({params_m(layers_rss):.0f}M parameters, AdamW), one iteration saved, one resumed:")
    print("| parallel | processes | peak RSS MB |\n| --- | ---: | ---: |")
    for nproc, parallel in ((1, "none"), (2, "ddp"), (2, "fsdp"), (4, "fsdp")):
        done, peak, error = trains_and_resumes(nproc, parallel, layers_rss, None)
        print(f"| {parallel} | {nproc} | {peak:,.0f} |" if done else f"| {parallel} | {nproc} | "
              f"failed: {error} |", flush=True)
    low, high = (int(n) for n in layers.split(","))
    print(f"\nthe largest model that trains, saves and resumes on 2 processes, each under "
          f"ulimit -v {limit_gb} GB:")
    found = {parallel: largest(parallel, low, high, limit_gb) for parallel in ("ddp", "fsdp")}
    print("| parallel | n_layer | parameters | one more layer |\n| --- | ---: | ---: | --- |")
    for parallel, (n_layer, why) in found.items():
        print(f"| {parallel} | {n_layer} | {params_m(n_layer):.0f}M | {why} |")


if __name__ == "__main__":
    typer.run(main)
