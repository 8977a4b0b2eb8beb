"""This machine's best matmul throughput, timed: the peak that model FLOPs utilisation (MFU)
is measured against where no datasheet figure is known (a CPU, an unlisted GPU).
machine/perf.py's peak_flops keeps the figure in the cache folder and imports this only
when the cache lacks it, which is once per machine, dtype and thread count.

Usage:
    from machine.peak import measure_peak_flops
    flops = measure_peak_flops(torch.device("cpu"), torch.float32)   # FLOP/s
"""

from __future__ import annotations

import time

import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """This machine's matmul throughput in FLOP/s: the best of several timings of square
    matmuls, since other work on the machine can only slow one down. On a GPU each timing
    spans several large matmuls so that launch and sync costs do not count. On a CPU a
    matmul is 1024 wide, or narrower where that would take over 50 ms, because a CPU without
    bf16 arithmetic emulates it, far slower than fp32."""
    generator = torch.Generator(device=device).manual_seed(0)  # leave the global RNG alone

    def sync() -> None:  # the clock is read only once the device has finished its queue
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timings(n: int, per_timing: int, count: int) -> list[float]:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        times = []
        for _ in range(count):
            sync()
            t0 = time.perf_counter()
            for _ in range(per_timing):
                a @ b
            sync()
            times.append((time.perf_counter() - t0) / per_timing)
        return times

    n, per_timing = (4096, 10) if device.type == "cuda" else (1024, 1)
    if device.type == "cpu":
        rate = 2 * 256**3 / min(timings(256, 1, 2))  # a rough rate, to size the matmul by
        while n > 256 and 2 * n**3 / rate > 0.05:
            n //= 2
    return 2 * n**3 / min(timings(n, per_timing, 10)[1:])  # the first warms up
