"""The number format a run computes in: what `dtype = "auto"` chooses, and why.

Usage:
    from training.precision import autocast_for, choose_dtype
    dtype, why = choose_dtype("auto", device)   # torch.bfloat16, "auto: the GPU supports bf16"
    with autocast_for(dtype, device, sharded=False): ...   # the forward passes in that dtype

auto is bfloat16 where the hardware multiplies bf16 natively (a GPU that supports it, a CPU
with avx512_bf16 or amx_bf16), else float32, because emulated bf16 is much slower
(docs/performance.md); it depends on the machine alone, so a command's numbers repeat.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from machine.device import DTYPES, DeviceError, cpu_flags, native_bf16

if TYPE_CHECKING:
    from weights.checkpoint import TrainState


def choose_dtype(name: str, device: torch.device, saved: TrainState | None = None,
                 sharded: bool = False) -> tuple[torch.dtype, str]:
    """The compute dtype for `name` (auto, float32, bfloat16 or float16) on `device`, and
    why, in a few words for a run's first lines. Under auto, a resumed run keeps its dtype,
    and a model sharded across CPU processes trains in float32."""
    if name != "auto":
        if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise DeviceError("dtype bfloat16 is not supported on this GPU; use --dtype float16")
        return DTYPES[name], "as configured"
    if saved is not None and saved.dtype is not None:
        return DTYPES[saved.dtype], "auto: as the run being resumed chose"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bf16"
        return torch.float32, "auto: the GPU has no bf16"
    if device.type != "cpu":
        return torch.float32, f"auto: float32 on {device.type}"
    if sharded:
        return torch.float32, "auto: a sharded model on CPUs trains in float32"
    return choose_cpu_dtype(cpu_flags())


def autocast_for(dtype: torch.dtype, device: torch.device, sharded: bool) -> AbstractContextManager:
    """autocast to dtype, or nothing for float32 and for FSDP on a GPU, whose mixed precision casts."""
    if dtype == torch.float32 or (sharded and device.type == "cuda"):
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def choose_cpu_dtype(flags: frozenset[str] | set[str]) -> tuple[torch.dtype, str]:
    """auto on a CPU with these feature flags, and why."""
    flag = native_bf16(flags)
    if flag:
        return torch.bfloat16, f"auto: the CPU multiplies bf16 natively ({flag})"
    return torch.float32, "auto: the CPU has no native bf16 (no avx512_bf16 or amx_bf16)"
