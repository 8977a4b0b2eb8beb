"""Measuring speed honestly: wait for the device before reading the clock, and measure the
machine's own matmul peak, the yardstick for model FLOPs utilisation (MFU).

Usage:
    from perf import measure_peak_flops, sync
    peak = measure_peak_flops(torch.device("cpu"), torch.float32)   # FLOP/s
"""

from __future__ import annotations

import statistics
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
