"""How much memory a stretch of work took: what the benchmarks print beside their speeds.

Usage:
    from measure.memory import memory_mb, reset_peak_memory
    reset_peak_memory(device); work(); now, peak = memory_mb(device)   # MB
"""

from __future__ import annotations

import sys

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window for memory_mb."""
    if device.type == "cuda":
        # before CUDA's first allocation there is no peak to reset (and torch refuses to)
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(device)
    elif sys.platform == "linux":
        # the CPU allocator keeps no statistics, but Linux tracks the process's resident
        # high-water mark, and writing 5 to clear_refs lowers it to the current resident size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def memory_mb(device: torch.device) -> tuple[float, float] | None:
    """(now, peak since reset_peak_memory) in MB: allocated tensors on CUDA, or the resident
    size of the whole process (weights included) on a Linux CPU; None elsewhere."""
    if device.type == "cuda":
        return (torch.cuda.memory_allocated(device) / 2**20,
                torch.cuda.max_memory_allocated(device) / 2**20)
    if sys.platform == "linux":
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                  if k in ("VmRSS", "VmHWM")}
        return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024
    return None
