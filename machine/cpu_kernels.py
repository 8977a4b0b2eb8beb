"""Three of the model's operations with their gradients written out, for devices other than
CUDA: RMSNorm, relu(h)^2 and the rotation of rotary positions.

Usage:
    from machine.cpu_kernels import ReLUSquared, RMSNormFunction, RotatePairs
    y = RMSNormFunction.apply(x, 1e-5)    # x / sqrt(mean(x^2) + eps), no gain
    h = ReLUSquared.apply(h)              # relu(h)^2
    q = RotatePairs.apply(q, cos, sin)    # model.apply_rope's rotation, (B, T, heads, hd)

Away from CUDA, each of these is made of several small operations, and PyTorch passes over
the whole tensor once for each of them, forward and backward. On a CPU that is much of a
small model's training step. In float32 they run as loops written in C (cpu_kernels.c),
which pass over each tensor once; in other dtypes, or where no C compiler is found, as
PyTorch operations, fewer than autograd would record for the same formula. Both give the
values and gradients of the plain operations (tests/test_model.py). docs/performance.md
has the measurements.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

SOURCE = Path(__file__).with_name("cpu_kernels.c")


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """cpu_kernels.c, built once for this CPU and kept in the cache; None where it cannot be
    built, which is said once."""
    from machine.cbuild import BuildError, build_library  # the compiler: only when it is needed
    try:
        lib = build_library(SOURCE, [], "the CPU training kernels",
                            instead="train with PyTorch's operations, slower")
    except BuildError as e:
        print(f"note: {e}; training uses PyTorch's operations instead", file=sys.stderr)
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.rms_norm_forward.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, f32]
    lib.rms_norm_backward.argtypes = [ptr, ptr, ptr, ptr, i64, i64]
    lib.relu_square_forward.argtypes = [ptr, ptr, i64]
    lib.relu_square_backward.argtypes = [ptr, ptr, ptr, i64]
    lib.rotate_pairs.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32]
    return lib


def in_c(*tensors: torch.Tensor, contiguous: bool = True) -> ctypes.CDLL | None:
    """The C kernels, if they can run on these tensors: float32 on the CPU, and contiguous
    unless the kernel takes the tensors' strides itself."""
    if torch.compiler.is_compiling():  # torch.compile fuses the plain operations itself
        return None
    if all(t.dtype == torch.float32 and t.device.type == "cpu"
           and (t.is_contiguous() or not contiguous) for t in tensors):
        return kernels()
    return None


def row_groups(x: torch.Tensor) -> tuple[int, int] | None:
    """x's rows (its last dimension) as groups of consecutive rows, the groups evenly apart,
    as (rows in a group, floats from one group to the next); None if x is not laid out so.
    A contiguous tensor is one group; the queries and keys split from one projection's
    output (model.py's qk) are a group a token, with the values' heads between groups."""
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
        groups = row_groups(x)
        if groups and (lib := in_c(x, contiguous=False)):
            y = torch.empty(x.shape, dtype=x.dtype)
            r = x.new_empty(x.shape[:-1] + (1,))
            lib.rms_norm_forward(x.data_ptr(), y.data_ptr(), r.data_ptr(), y.numel() // x.size(-1),
                                 *groups, x.size(-1), eps)
            ctx.save_for_backward(y, r)
            return y
        xf = x.float()  # fp32 under bf16 autocast too, as F.rms_norm computes
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)  # (..., 1)
        y = xf * r
        ctx.save_for_backward(y, r)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        y, r = ctx.saved_tensors
        if lib := in_c(g, y):
            dx, n = torch.empty_like(g), g.size(-1)
            lib.rms_norm_backward(g.data_ptr(), y.data_ptr(), r.data_ptr(), dx.data_ptr(),
                                  g.numel() // n, n)
            return dx, None
        gf = g.float()
        return torch.addcmul(gf * r, y, r * (gf * y).mean(-1, keepdim=True), value=-1).to(g.dtype), None


class ReLUSquared(torch.autograd.Function):
    """relu(h)^2, whose gradient is 2 relu(h) g."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        if lib := in_c(h):
            out = torch.empty_like(h)
            lib.relu_square_forward(h.data_ptr(), out.data_ptr(), h.numel())
            ctx.save_for_backward(h)
            return out
        r = F.relu(h)
        ctx.save_for_backward(r)  # relu(r) is r: the backward below serves both
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
    """model.apply_rope's rotation of (B, T, heads, hd) queries or keys, with (T, 1, hd / 2)
    tables whose row t holds the angles of the t-th token of every sequence, in one pass.
    Its gradient turns each pair back by the same angle. Only the C kernels run it:
    model.apply_rope asks can_rotate first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return rotate(g.contiguous(), cos, sin, -1.0), None, None


def can_rotate(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether RotatePairs can turn x: float32 on the CPU, with one table row for all the
    sequences' t-th tokens (not a row per sequence, as a server's batch has), and the C
    kernels built."""
    return (x.dtype == torch.float32 and x.dim() == 4 and cos.dim() == 3
            and in_c(x, cos, contiguous=False) is not None and cos.is_contiguous())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, direction: float) -> torch.Tensor:
    B, T, heads, hd = x.shape
    y = torch.empty_like(x)
    kernels().rotate_pairs(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), B * T, T,
                           heads, hd // 2, direction)
    return y
