"""Measuring speed honestly: wait for the device before reading the clock, and measure the
machine's own matmul peak, the yardstick for model FLOPs utilisation (MFU).

Usage:
    from perf import measure_peak_flops, sync
    peak = measure_peak_flops(torch.device("cpu"), torch.float32)   # FLOP/s
    reset_peak_memory(device); ...; now, peak = memory_mb(device)   # MB, peak of "..."
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def sync(device: torch.device) -> None:
    """Wait until the device has finished the queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """This machine's matmul throughput in FLOP/s (median of a few square matmuls),
    measured rather than looked up so that MFU is honest on any CPU or GPU."""
    n = 2048 if device.type == "cuda" else 1024
    generator = torch.Generator(device=device).manual_seed(0)  # leave the global RNG alone
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times[1:])  # the first run warms up


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window for memory_mb."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif sys.platform == "linux":
        # the CPU allocator keeps no statistics, but Linux tracks the process's resident
        # high-water mark, and writing 5 to clear_refs lowers it to the current resident size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def memory_mb(device: torch.device) -> tuple[float, float] | None:
    """(now, peak since reset_peak_memory) in MB: allocated tensors on CUDA, the resident
    size of the whole process (weights included) on a Linux CPU; None where unknown."""
    if device.type == "cuda":
        return (torch.cuda.memory_allocated(device) / 2**20,
                torch.cuda.max_memory_allocated(device) / 2**20)
    if sys.platform == "linux":
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                  if k in ("VmRSS", "VmHWM")}
        return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024
    return None
