"""The machine: which device to compute on, its number formats, what its CPU can do, and what
torch's compiler costs here.

Usage:
    from machine.device import DTYPES, resolve_device, cpu_flags, native_bf16
    device = resolve_device("auto")          # cuda, else mps, else cpu
    native_bf16(cpu_flags())                 # "avx512_bf16", "amx_bf16" or None
    check_compile(device, instead="drop --compile")   # one line if torch.compile cannot work
    reuse_freed_memory()                     # a training process keeps its freed memory
    AdamW = unguarded(torch.optim.AdamW)     # its first step does not import the compiler

Every layer above asks here; none reads /proc/cpuinfo or names a device type of its own.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import platform
from pathlib import Path

import torch

from machine.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """The flag among `flags` of an x86 unit that multiplies bf16 in hardware, or None."""
    return next((flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags), None)


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
    before the work, not a long traceback at the first step."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:  # InvalidCxxCompiler or a failed build, wrapped by dynamo
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DeviceError(f"torch.compile does not work on {device} here ({reason.strip()}); "
                          f"{instead}, or install a C++ compiler (g++, or set CXX)") from None


def unguarded(optimizer: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The optimizer class with its methods unwrapped from torch._disable_dynamo, whose first call
    imports the compiler, which is slow to import and never runs on these optimizers
    (docs/performance.md); the step runs in no_grad, as torch's wrapper ran it."""
    methods = {name: inspect.unwrap(getattr(optimizer, name))  # follows __wrapped__ to the function
               for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict", "step")}
    methods["step"] = torch.no_grad()(methods["step"])
    return type(optimizer.__name__, (optimizer,), methods)


# glibc's mallopt parameters (malloc.h) and Linux's madvise advice (sys/mman.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, MADV_HUGEPAGE = -1, -2, -3, 14


def reuse_freed_memory(huge_pages: bool = True) -> None:
    """Have glibc keep freed tensors' memory for reuse (by default each step's activations
    arrive as fresh pages, each a page fault), with huge_pages in 2 MB pages where Linux gives
    them, because a step passes over its activations several times, and over 4 KB pages it
    misses the CPU's cache of address translations (the TLB) far more often. Kept memory
    counts against ulimit -v, so where that is set, and away from glibc, nothing changes."""
    try:
        import resource
        if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
            return
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # blocks this large or larger still come from mmap
    except (ImportError, OSError, AttributeError, TypeError):  # Windows has no resource, macOS no mallopt
        return
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)  # the free memory the heap keeps before giving it back
    if not huge_pages:
        return
    # the heap grows by 1 GB of address space now (only touched pages take memory), and Linux
    # is asked to back it with 2 MB pages, which it refuses, harmlessly, where it has none
    libc.mallopt(M_TOP_PAD, 1 << 30)
    torch.empty(31 << 20, dtype=torch.uint8)  # a block that only new heap holds, freed at once
    maps = Path("/proc/self/maps")  # absent where /proc is not mounted
    for line in maps.read_text().splitlines() if maps.exists() else []:
        if line.endswith("[heap]"):
            start, end = (int(address, 16) for address in line.split()[0].split("-"))
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
