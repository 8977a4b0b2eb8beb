"""Which device and number format to compute in: the one dtype table, and the choice
that `--dtype auto` makes.

Usage:
    from precision import DTYPES, resolve_device, resolve_dtype
    device = resolve_device("auto")
    dtype, why = resolve_dtype("auto", device)      # torch.bfloat16, "the CPU has avx512_bf16"

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

import functools
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Linux /proc/cpuinfo flags of the x86 units that multiply bf16 in hardware
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# what bf16 must gain to be worth its rounding: within noise of fp32, keep fp32
MIN_BF16_SPEEDUP = 1.15


class DeviceError(ValueError):
    """A device or dtype this machine does not have; the message names the alternative."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them; empty where there is no /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    line = next((line for line in cpuinfo.read_text().splitlines()
                 if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def cpu_identity() -> str:
    """The CPU's architecture and feature flags: what `-march=native` builds for."""
    return f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"


def native_bf16(flags: frozenset[str] | set[str]) -> str | None:
    """The flag that shows native bf16 arithmetic among `flags`, or None."""
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


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


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The configured device; "auto" is CUDA, else MPS, else the CPU. Under torchrun each
    process takes the GPU of its local rank."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if name == "auto":
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r} is not a device; use auto, cpu, cuda, cuda:N "
                          f"or mps") from None
    if device.type not in ("cpu", "cuda", "mps"):  # xpu, meta, vulkan ...: torch's, not ours
        raise DeviceError(f"device {name!r} is not one this project runs on; use auto, cpu, "
                          f"cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device is {name} but no CUDA GPU is available to this torch; "
                          f"use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"device is {name} but there are {torch.cuda.device_count()} CUDA "
                          f"GPUs; use cuda:0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device is mps but MPS is not available; use --device cpu")
    return device


def check_compile(device: torch.device, instead: str) -> None:
    """Compile and run a two-op function on `device` now, so that a torch.compile that cannot
    work here (no C++ compiler for inductor's CPU kernels, one that fails) is one line
    before the work, not a long traceback at the first step. Seconds the first time;
    inductor caches the build."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:  # InvalidCxxCompiler, a failed build, wrapped by dynamo
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DeviceError(f"torch.compile does not work on {device} here ({reason.strip()}); "
                          f"{instead}, or install a C++ compiler (g++, or set CXX)") from None


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
