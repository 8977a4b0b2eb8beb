"""Three of the model's operations with their gradients written out, for training on a CPU:
RMSNorm, relu(h)^2 and the rotation of rotary positions; and attention's detour to fp32.

Usage:
    from machine.cpu_kernels import ReLUSquared, on_cpu
    @on_cpu(ReLUSquared.apply)   # as model.py writes them: on a CPU the kernel runs instead,
    def relu_squared(h): return F.relu(h).square()   # with the same values and gradients

Each is several small operations, and PyTorch passes over the whole tensor once for each, forward
and backward, which on a CPU is much of a small model's step. In float32 they run as loops in C
(cpu_kernels.c) that pass over each tensor once, else (bf16, torch.compile, no C compiler) as a
few PyTorch operations, with the plain operations' values and gradients (tests/test_model.py).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F


def on_cpu(kernel: Callable, where: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a function of plain torch operations so that a call on a CPU tensor goes to kernel
    (the same values and gradients) unless where(*args) is false; the tests compare __wrapped__."""
    def decorate(plain: Callable) -> Callable:
        @functools.wraps(plain)
        def either(x: torch.Tensor, *rest: Any) -> torch.Tensor:
            if x.device.type == "cpu" and (where is None or where(x, *rest)):
                return kernel(x, *rest)
            return plain(x, *rest)
        return either
    return decorate


def fp32_below(keys: int) -> Callable[[Callable], Callable]:
    """Decorate attention(q, k, v, ...) to compute in fp32, with autocast off lest it cast back, where
    q is bf16 on a CPU with fewer than `keys` keys, because torch's kernel is slower there in bf16."""
    def decorate(attention: Callable) -> Callable:
        @functools.wraps(attention)
        def either(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **named: Any) -> Any:
            if q.device.type != "cpu" or q.dtype != torch.bfloat16 or k.size(2) >= keys:
                return attention(q, k, v, *rest, **named)
            with torch.autocast("cpu", enabled=False):
                return attention(q.float(), k.float(), v.float(), *rest, **named).to(q.dtype)
        return either
    return decorate


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """cpu_kernels.c, built once for this CPU and kept in the cache, or None where it cannot
    be built (a note says so, once)."""
    from machine.cbuild import BuildError, build_library  # imported only when needed
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {"rms_norm_forward": [ptr, ptr, ptr, i64, i64, i64, i64, f32],
                  "rms_norm_backward": [ptr, ptr, ptr, ptr, i64, i64],
                  "relu_square_forward": [ptr, ptr, i64],
                  "relu_square_backward": [ptr, ptr, ptr, i64],
                  "rotate_pairs": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32]}
    try:
        lib = build_library(Path(__file__).with_name("cpu_kernels.c"), [], "cpu_kernels.c",
                            instead="let the model run PyTorch's operations, slower",
                            exports=tuple(signatures))
    except BuildError as e:
        print(f"note: {e}; the model runs PyTorch's operations instead", file=sys.stderr)
        return None
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def in_c(*tensors: torch.Tensor, contiguous: bool = True) -> ctypes.CDLL | None:
    """The C kernels, if they can run on these tensors: float32 on the CPU, and contiguous
    unless the kernel takes the strides itself. They are not used under torch.compile,
    which fuses the plain operations itself."""
    if not torch.compiler.is_compiling() and all(
            t.dtype == torch.float32 and t.device.type == "cpu" and (t.is_contiguous() or not contiguous)
            for t in tensors):
        return kernels()
    return None


def row_groups(x: torch.Tensor) -> tuple[int, int] | None:
    """x's rows as evenly spaced groups of consecutive rows: (rows in a group, floats from one
    group to the next), or None. A contiguous tensor is one group; the queries and keys split
    from one projection (model.py's qkv) form one group per token."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) != x.size(-1):
        return None
    try:
        groups = x.view(-1, *x.shape[-2:])  # fails where the leading dimensions do not merge
    except RuntimeError:
        return None
    return groups.size(1), groups.stride(0)


class RMSNormFunction(torch.autograd.Function):
    """rms_norm over the last dimension, without a gain. For y = x r, r = 1 / rms(x), the
    input's gradient is r (g - y mean(g y))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        if (groups := row_groups(x)) and (lib := in_c(x, contiguous=False)):
            y, r = torch.empty(x.shape), x.new_empty(x.shape[:-1] + (1,))
            lib.rms_norm_forward(x.data_ptr(), y.data_ptr(), r.data_ptr(), r.numel(), *groups,
                                 x.size(-1), eps)
        else:
            xf = x.float()  # computed in fp32 even under bf16 autocast, as F.rms_norm does
            r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)  # (..., 1)
            y = xf * r
        ctx.save_for_backward(y, r)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        y, r = ctx.saved_tensors
        if lib := in_c(g, y):
            dx = torch.empty_like(g)
            lib.rms_norm_backward(g.data_ptr(), y.data_ptr(), r.data_ptr(), dx.data_ptr(),
                                  r.numel(), g.size(-1))
            return dx, None
        gf = g.float()
        return torch.addcmul(gf * r, y, r * (gf * y).mean(-1, keepdim=True), value=-1).to(g.dtype), None


class ReLUSquared(torch.autograd.Function):
    """relu(h)^2, whose gradient is 2 relu(h) g. It keeps h for the backward pass (or relu(h),
    which serves as well, because relu(relu(h)) is relu(h))."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        if lib := in_c(h):
            out = torch.empty_like(h)
            lib.relu_square_forward(h.data_ptr(), out.data_ptr(), h.numel())
            ctx.save_for_backward(h)
            return out
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        h, = ctx.saved_tensors
        if lib := in_c(h, g):
            dh = torch.empty_like(h)
            lib.relu_square_backward(h.data_ptr(), g.data_ptr(), dh.data_ptr(), h.numel())
            return dh
        return (g * F.relu(h)).mul_(2)


class RotatePairs(torch.autograd.Function):
    """model.apply_rope's rotation of (B, T, heads, hd) queries or keys in one pass, with
    (T, 1, hd / 2) tables whose row t turns the t-th token of every sequence. The gradient
    turns each pair back by the same angle, and it runs where can_rotate says it can."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return rotate(g.contiguous(), cos, sin, -1.0), None, None


def can_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether RotatePairs can turn x. It needs float32 on the CPU, the C kernels, and one
    table row per position shared by every sequence (a server's batch has a row per sequence)."""
    return (x.dim() == 4 and cos.dim() == 3 and cos.is_contiguous() and sin.is_contiguous()
            and in_c(x, cos, contiguous=False) is not None)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, direction: float) -> torch.Tensor:
    B, T, heads, hd = x.shape
    y = torch.empty_like(x)
    kernels().rotate_pairs(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), B * T, T,
                           heads, hd // 2, direction)
    return y
