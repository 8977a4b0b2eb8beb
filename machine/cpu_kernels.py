"""Two of the model's operations with their gradients written out, for devices other than CUDA.

Usage:
    from machine.cpu_kernels import ReLUSquared, RMSNormFunction
    y = RMSNormFunction.apply(x, 1e-5)    # x / sqrt(mean(x^2) + eps), no gain
    h = ReLUSquared.apply(h)              # relu(h)^2

Away from CUDA, F.rms_norm and relu(h)^2 are made of small operations, and autograd's way
back through them passes over the tensor once per operation. Written out, each backward
makes as few passes as its formula needs; values and gradients equal the composed
operations' (tests/test_model.py). docs/model.md has the measurements.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


class RMSNormFunction(torch.autograd.Function):
    """rms_norm over the last dimension, without a gain. For y = x r, r = 1 / rms(x), the
    input's gradient is r (g - y mean(g y))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()  # fp32 under bf16 autocast too, as F.rms_norm computes
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)  # (..., 1)
        y = xf * r
        ctx.save_for_backward(y, r)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        y, r = ctx.saved_tensors
        gf = g.float()
        return torch.addcmul(gf * r, y, r * (gf * y).mean(-1, keepdim=True), value=-1).to(g.dtype), None


class ReLUSquared(torch.autograd.Function):
    """relu(h)^2, whose gradient is 2 relu(h) g: one saved tensor and two products on the
    way back."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(r := F.relu(h))
        return r * r

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return (g * ctx.saved_tensors[0]).mul_(2)
