"""Measuring speed honestly: wait for the device before reading the clock, and know the
peak that model FLOPs utilisation (MFU) is measured against.

Usage:
    from machine.perf import memory_room, peak_flops, sync
    peak, source = peak_flops(torch.device("cpu"), torch.float32)   # FLOP/s, and its source
    memory_room(device)              # (bytes, "free" or the ulimit -v that bounds them), or None
    check_room("this run", {"the weights": n}, device, "lower batch_size", ConfigError)
    with out_of_memory("this run", device, "lower batch_size", ConfigError): ...
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from machine.device import cpu_name
from machine.files import cache_dir, write_bytes_atomic


def sync(device: torch.device) -> None:
    """Wait until the device has finished the queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The FLOP/s that MFU is measured against, and where the figure comes from: a known
    GPU's datasheet bf16 peak (whatever the training dtype, as is usual); else this
    machine's best matmul throughput in `dtype`, measured once and kept in the cache folder
    under the CPU's name, the dtype and the thread count, so that a busy moment at a run's
    start never moves the yardstick."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    if device.type == "cuda":  # the datasheets are read on a GPU only
        from machine.datasheets import datasheet_peak_flops
        if (flops := datasheet_peak_flops(where)) is not None:
            return flops, f"datasheet bf16 peak of the {where}"
    kind = str(dtype).removeprefix("torch.")
    key = f"{where}, {kind}, {torch.get_num_threads()} threads"
    path = cache_dir() / "peak_flops.json"
    known = cached_peaks(path)
    if key not in known:  # timed once, by the first run with this key (machine/peak.py)
        from machine.peak import measure_peak_flops
        known[key] = measure_peak_flops(device, dtype)
        with suppress(OSError):  # a cache that cannot be written is measured again next time
            write_bytes_atomic(path, (json.dumps(known, indent=1) + "\n").encode())
    return known[key], f"this machine's best {kind} matmul, measured once and kept in {path}"


def cached_peaks(path: Path) -> dict[str, float]:
    """The figures in the cache file that a machine can have measured, 10^6 to 10^18 FLOP/s.
    A file that is not a JSON object, and a figure outside that range (zero, negative, NaN, text),
    which would make MFU negative or astronomical, are measured again and written over."""
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # the file is missing, not UTF-8, or not JSON
        return {}
    return {key: float(value) for key, value in known.items() if type(value) in (int, float)
            and 1e6 <= value <= 1e18} if isinstance(known, dict) else {}


def memory_room(device: torch.device) -> tuple[int, str] | None:
    """The bytes the device can still give, and what bounds them, in words: "free" memory
    (a GPU's, or a Linux CPU's MemAvailable, the RAM that needs no swapping), or on a CPU
    the process's own limit (ulimit -v, as shared login nodes set it) when that is lower,
    which bounds the address space it may still map. None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "free"
    if device.type != "cpu" or sys.platform != "linux":
        return None
    import resource
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return free, "free"
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    left = max(limit - mapped, 0)
    return (left, f"left under this process's limit of {limit / 1e9:,.1f} GB (ulimit -v)") \
        if left < free else (free, "free")


def check_room(work: str, needs: dict[str, int], device: torch.device, fix: str,
               error: Callable[[str], Exception], processes: int = 1) -> None:
    """The one memory check that every door calls (training, evaluation, the decoding
    benchmark, the server) before it allocates: `error` naming each of `needs` (bytes, by
    what they hold) and what bounds them, where all cannot fit in what memory_room finds,
    because on a CPU the work would swap the machine to a standstill or end in the
    allocator's traceback. `processes` doing the same work share a CPU's free memory."""
    room = memory_room(device)
    if room is None:
        return
    available, bound = room
    processes = processes if device.type == "cpu" and bound == "free" else 1
    need = processes * sum(needs.values())
    if need > available:
        parts = ", ".join(f"{n / 1e9:,.1f} for {what}" for what, n in needs.items())
        parts = f"{processes} processes, each {parts}" if processes > 1 else parts
        raise error(f"{work} needs at least {need / 1e9:,.1f} GB ({parts}), but {device.type} "
                    f"has {available / 1e9:,.1f} GB {bound}; {fix}")


@contextmanager
def out_of_memory(work: str, device: torch.device, fix: str,
                  error: Callable[[str], Exception]) -> Iterator[None]:
    """Work that check_room let through and the allocator then failed (its needs are lower
    bounds, and other processes take memory too) ends as its refusal would: one line naming
    the work, what bounds the memory, and the fix, not the allocator's traceback."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is one, and a CPU raises a plain one
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        room = memory_room(device)
        bound = f", with {room[0] / 1e9:,.1f} GB {room[1]}" if room else ""
        raise error(f"{work} ran out of memory on {device.type}{bound}; {fix}") from None
