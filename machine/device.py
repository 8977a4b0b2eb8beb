"""The machine: which device to compute on, its number formats, and what its CPU can do.

Usage:
    from machine.device import DTYPES, resolve_device, cpu_flags, native_bf16
    device = resolve_device("auto")          # cuda, else mps, else cpu
    native_bf16(cpu_flags())                 # "avx512_bf16", "amx_bf16" or None
    check_compile(device, instead="drop --compile")   # one line if torch.compile cannot work
    reuse_freed_memory()                     # a training process keeps its freed memory

Every layer above asks here; none reads /proc/cpuinfo or names a device type of its own.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

import torch

from machine.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Linux /proc/cpuinfo flags of the x86 units that multiply bf16 in hardware
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class DeviceError(UserError):
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
    """The CPU's architecture and feature flags, which decide what `-march=native` builds for."""
    return f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"


def cpu_name() -> str:
    """The CPU's model name and the flags that decide its speed here (AVX-512, native bf16,
    AMX), for a figure's label, because the machines we measure on differ in exactly these."""
    cpuinfo = Path("/proc/cpuinfo")
    info = cpuinfo.read_text() if cpuinfo.exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    shown = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return f"{name} ({', '.join(shown) or 'no avx512'})"


def native_bf16(flags: frozenset[str] | set[str]) -> str | None:
    """The flag that shows native bf16 arithmetic among `flags`, or None."""
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


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
    if device.type not in ("cpu", "cuda", "mps"):  # xpu, meta, vulkan ... are torch's, not ours
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
    work here (no C++ compiler for inductor's CPU kernels, or one that fails) is one line
    before the work, not a long traceback at the first step. The first call builds a kernel,
    which inductor caches."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:  # InvalidCxxCompiler or a failed build, wrapped by dynamo
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DeviceError(f"torch.compile does not work on {device} here ({reason.strip()}); "
                          f"{instead}, or install a C++ compiler (g++, or set CXX)") from None


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def reuse_freed_memory() -> None:
    """Have glibc keep the memory of freed tensors for reuse. By default it gives a large
    freed block back to the kernel, so each step's activations arrive as fresh pages, each a
    page fault when first touched. Kept memory counts against ulimit -v, so where that is
    set, and away from glibc, nothing changes."""
    try:
        import resource
        if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
            return
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (ImportError, OSError, AttributeError, TypeError):  # Windows, macOS, musl
        return
    mallopt(M_MMAP_THRESHOLD, 32 << 20)  # blocks this large or larger still come from mmap
    mallopt(M_TRIM_THRESHOLD, 1 << 30)  # the free memory the heap keeps before giving it back
