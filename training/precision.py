"""The number format a run trains in: the choice that `--dtype auto` makes.

Usage:
    from training.precision import resolve_dtype
    dtype, why = resolve_dtype("auto", device, step)  # torch.bfloat16, "the CPU has avx512_bf16 ..."

On a GPU, auto means bf16 autocast wherever the GPU supports it. On a CPU it is a question
of hardware. Without native bf16 arithmetic (the avx512_bf16 or amx_bf16 flags) bf16 is
emulated and about three times slower than fp32, so auto keeps fp32. With it, bf16 can be
faster or slower: one CPU ran a small model's step 1.4 times faster in bf16, while another
with avx512_bf16 (but no AMX) ran the same step twice as slowly, and a single Linear layer can
mislead (one measured 1.84x faster in bf16 on a CPU where the quickstart's whole step was 11%
slower). So there auto times the step that will run: the caller's forward, backward and
optimizer step at the run's shape, a few times in each dtype.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from machine.device import DTYPES, DeviceError, cpu_flags, native_bf16

# what bf16 must gain to be worth its rounding: within noise of fp32, keep fp32
MIN_BF16_SPEEDUP = 1.15


def bf16_speedup(step: Callable[[torch.dtype], None], rounds: int = 4) -> float:
    """How many times faster step(torch.bfloat16) runs than step(torch.float32), on medians
    of alternating rounds (so that a busy moment costs both), after one to warm up. Few:
    they are part of the run's start, and a speed-up near the threshold is a choice between
    two near-equal steps."""
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    for i in range(rounds + 1):
        for dtype, runs in times.items():
            t0 = time.perf_counter()
            step(dtype)
            if i >= 1:
                runs.append(time.perf_counter() - t0)
    return statistics.median(times[torch.float32]) / statistics.median(times[torch.bfloat16])


def choose_cpu_dtype(flags: frozenset[str] | set[str],
                     measure_speedup: Callable[[], float]) -> tuple[torch.dtype, str]:
    """auto on a CPU with these feature flags: bf16 where it is native and measured faster
    (measure_speedup is called only then), else fp32; and why."""
    flag = native_bf16(flags)
    if not flag:
        return torch.float32, "auto: the CPU has no native bf16 (no avx512_bf16 or amx_bf16)"
    speedup = measure_speedup()
    if speedup >= MIN_BF16_SPEEDUP:
        return torch.bfloat16, (f"auto: the CPU has {flag} and this run's step ran "
                                f"{speedup:.2f}x as fast in bf16 as in fp32")
    return torch.float32, (f"auto: the CPU has {flag} but this run's step ran only "
                           f"{speedup:.2f}x as fast in bf16 as in fp32; --dtype bfloat16 "
                           f"forces it")


def resolve_dtype(name: str, device: torch.device,
                  step: Callable[[torch.dtype], None] | None = None) -> tuple[torch.dtype, str]:
    """The compute dtype for `name` (auto, float32, bfloat16 or float16) on `device`, and
    why, in a few words for the first lines of a run. On a CPU with native bf16, auto times
    `step` (one training step in a given dtype) in both; without a step it keeps fp32."""
    if name != "auto":
        if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise DeviceError("dtype bfloat16 is not supported on this GPU; use --dtype float16")
        return DTYPES[name], "as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bf16"
        return torch.float32, "auto: the GPU has no bf16"
    if device.type == "cpu" and step is not None:
        return choose_cpu_dtype(cpu_flags(), lambda: bf16_speedup(step))
    return torch.float32, f"auto: float32 on {device.type}"
