"""How much memory a stretch of work took, what the benchmarks print beside their speeds, and
what decoding will take, which the memory checks count before it starts.

Usage:
    from measure.memory import decode_needs, memory_mb, reset_peak_memory
    reset_peak_memory(device); work(); now, peak = memory_mb(device)   # MB
    check_room("--batch 8", decode_needs(model, 8, 256, c_step_tokens=64), device, fix, InputError)
"""

from __future__ import annotations

import sys

import torch

from cdecode import scratch_floats
from generate import new_kv_cache
from model import GPT


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


def cache_bytes_per_token(model: GPT) -> int:
    """The bytes of keys and values that all layers keep for one token. GQA keeps n_kv_head
    heads, not n_head, and an int8 model keeps its cache in float32."""
    cfg, cache = model.config, new_kv_cache(model, 1, 1)
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * cache.k[0].itemsize


def decode_needs(model: GPT, rows: int, max_len: int, c_step_tokens: int = 0) -> dict[str, int]:
    """The buffers that decoding `rows` sequences with a cache of max_len positions allocates,
    by what they hold (machine.perf.check_room's needs): the KV cache with each position's
    token id, one step's float32 logits, and the C step's scratch for the most tokens that
    one call of it takes, all rows together (0 where no C step runs)."""
    cfg = model.config
    needs = {f"the KV cache of {rows:,} rows x {max_len:,} positions":
             rows * max_len * (cache_bytes_per_token(model) + 8),
             f"the logits of {rows:,} rows": rows * cfg.vocab_size * 4}
    if c_step_tokens:
        needs["the C step's scratch"] = 4 * scratch_floats(cfg, c_step_tokens, max_len)
    return needs
