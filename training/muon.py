"""Muon, nanochat's and the modded-nanogpt speedruns' optimizer for the 2-D weights inside
the blocks (optimizer = "muon"): it orthogonalizes each matrix's smoothed gradient, so that
every direction of the update moves at the same rate. training/optimizer.py's
configure_optimizers builds it beside AdamW, and imports this only for a run that uses it.

Usage:
    from training.muon import Muon, orthogonalize
    opt = Muon([{"params": matrices}], lr=0.02, momentum=0.95, nesterov=True,
               ns_dtype=torch.float32)
    u = orthogonalize(g, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)   # about U V^T
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from training.distributed import is_dtensor
from training.unguarded import Unguarded


class Muon(Unguarded, torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in ns_dtype, on all the matrices of
    one shape in one batched product, and for a matrix in row_blocks, on each of its equal
    blocks of rows apart. torch's own Muon runs the iteration in bf16, which most x86 CPUs
    emulate far more slowly than fp32, and on one matrix at a time. The rest is torch's
    arithmetic, so without row_blocks a step equals torch.optim.Muon's to rounding."""

    def __init__(self, params, ns_dtype=torch.bfloat16, row_blocks: dict | None = None, **kwargs) -> None:
        if kwargs.get("adjust_lr_fn") not in (None, "original"):
            raise ValueError("this Muon scales the lr by the original rule only")
        super().__init__(params, **kwargs)
        self.ns_dtype, self.row_blocks = ns_dtype, row_blocks or {}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = self.blended(params, group["momentum"], group["nesterov"])
            blocks = [self.row_blocks.get(p, 1) for p in params]

            def newton_schulz(g: torch.Tensor, blocks: int, group: dict = group) -> torch.Tensor:
                return orthogonalize(g, group["ns_coefficients"], group["ns_steps"],
                                     group["eps"], self.ns_dtype, blocks)
            # Newton-Schulz needs each whole matrix, so sharded ones (FSDP) are shared out,
            # each orthogonalized on one process, with its rows handed back
            if any(is_dtensor(p) for p in params):
                from training.fsdp import each_on_one_process
                each = [lambda g, b=b: newton_schulz(g, b) for b in blocks]  # with its own blocks
                updates = each_on_one_process(updates, each)
            else:
                updates = by_shape(updates, blocks, newton_schulz)
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])  # decoupled weight decay
            for p, update, b in zip(params, updates, blocks, strict=True):
                # Muon's original lr rule: an orthogonal tall block has smaller entries, so its lr
                # is scaled by sqrt(rows/cols), where a block is p's shape[0] / b rows (b is 3 for
                # c_attn, whose queries, keys and values were orthogonalized apart, else 1)
                p.add_(update, alpha=-group["lr"] * math.sqrt(max(1.0, p.shape[0] / b / p.shape[1])))
        return loss

    def blended(self, params: list[torch.Tensor], momentum: float, nesterov: bool) -> list[torch.Tensor]:
        """Move each momentum buffer towards its gradient, buf = m buf + (1 - m) g, all in one call,
        and return the updates: the buffers, or with Nesterov momentum (1 - m) g + m buf."""
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        bufs, grads = [self.state[p]["momentum_buffer"] for p in params], [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        return list(torch._foreach_lerp(grads, bufs, momentum)) if nesterov else bufs


def by_shape(matrices: list[torch.Tensor], blocks: list[int],
             fn: Callable[[torch.Tensor, int], torch.Tensor]) -> list[torch.Tensor]:
    """fn(m, blocks) for each matrix m, in the matrices' order, computed in one call of fn on the
    stack of all the matrices of one shape and count of blocks (fn treats dimension 0 as a batch)."""
    results: list[torch.Tensor | None] = [None] * len(matrices)
    shapes: dict[tuple[torch.Size, int], list[int]] = {}
    for i, key in enumerate(zip((m.shape for m in matrices), blocks, strict=True)):
        shapes.setdefault(key, []).append(i)
    for (_, b), indices in shapes.items():
        stacked = fn(torch.stack([matrices[i] for i in indices]), b)
        for i, result in zip(indices, stacked, strict=True):
            results[i] = result
    return results


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype, blocks: int = 1) -> torch.Tensor:
    """Approximately U V^T for g = U S V^T, by Muon's quintic Newton-Schulz iteration in dtype,
    on each matrix of g, (..., rows, cols), or on each of its `blocks` equal blocks of rows. It
    pushes every singular value towards 1 (to about 0.5 to 1.5, which trains as well as 1)."""
    a, b, c = coefficients
    x = g.to(dtype).reshape(-1, g.size(-2) // blocks, g.size(-1))  # a stack, (n, rows, cols)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side, whose Gram matrix is the smaller one
        x = x.mT
    # divide each matrix by its norm, so that its singular values are at most 1, where the
    # iteration converges
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # A = X X^T
        # X <- aX + (bA + cA^2) X, as two fused multiply-adds: baddbmm(M, P, Q, beta=s, alpha=t)
        # is s M + t P Q, so the inner one is bA + cA A, and the outer one aX + (that) X
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(g.shape)
