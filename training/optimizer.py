"""The optimizers that update the model at every training step: AdamW, and Muon for the
matrices inside the blocks.

Usage:
    from training.optimizer import configure_optimizers
    optimizers = configure_optimizers(model, cfg, device, dtype)  # [AdamW] or [AdamW, Muon]

Two recipes, chosen by TrainConfig.optimizer: "adamw", GPT-2's, and "muon", nanochat's and the
speedruns', with Muon on the 2-D weights inside the blocks and AdamW on the rest. Muon
orthogonalizes each matrix's smoothed gradient, so that every direction of the update moves at
the same rate. That suits the hidden matrices; the embeddings, looked up a row at a time, take AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from machine.device import unguarded
from model import GPT
from training.config import TrainConfig
from training.distributed import is_dtensor


def muon_parameters(model: GPT) -> set[torch.nn.Parameter]:
    """The matrices that Muon trains: the 2-D weights inside the transformer blocks."""
    return {p for p in model.transformer.h.parameters() if p.dim() == 2 and p.requires_grad}


def configure_optimizers(model: GPT, cfg: TrainConfig, device: torch.device,
                         dtype: torch.dtype = torch.float32) -> list[torch.optim.Optimizer]:
    """The recipe's optimizers, each group with its "peak_lr" and the name its lr is logged as
    ("logged_as"). Muon orthogonalizes in bf16 only when the run's dtype is bf16."""
    trained = [p for p in model.parameters() if p.requires_grad]
    hidden = muon_parameters(model) if cfg.optimizer == "muon" else set()
    # AdamW's groups: the other matrices (the head, wpe), decayed as in nanoGPT; biases and norm
    # gains, which a pull towards zero only hurts, not decayed; and the lookup tables (an untied
    # wte, the bigram table), whose rows move only where their tokens appear, at embedding_lr, far
    # larger (as in nanochat), and not decayed, because decoupled decay shrinks a weight by
    # lr * weight_decay a step (1% at lr 0.1 and weight_decay 0.1), even in the rows of tokens
    # never seen. In the quickstart the head is in the first group (lr 5e-3), wte and wtb in the
    # third (lr 0.1), and the second is empty.
    tables = [] if model.config.tie_embeddings else [model.transformer.wte.weight]
    tables += [model.transformer.wtb.weight] if "wtb" in model.transformer else []
    rest = [p for p in trained if p not in hidden and all(p is not t for t in tables)]
    adamw_groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay,
         "peak_lr": cfg.learning_rate, "logged_as": "lr"},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0,
         "peak_lr": cfg.learning_rate, "logged_as": "lr"},
    ]
    if tables := [t for t in tables if t.requires_grad]:
        adamw_groups.append({"params": tables, "weight_decay": 0.0, "logged_as": "lr_embedding",
                             "peak_lr": cfg.embedding_lr or cfg.learning_rate})
    # the fused kernel updates all plain tensors in one pass; FSDP's sharded ones cannot use it
    sharded = any(is_dtensor(p) for p in trained)
    optimizers: list[torch.optim.Optimizer] = [AdamW(
        adamw_groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
        fused=device.type in ("cuda", "cpu") and not sharded)]
    if hidden:
        # in the model's order, because a checkpoint's optimizer state is matched by position
        matrices = [p for p in trained if p in hidden]
        # c_attn's rows are the queries', keys' and values' projections, which Muon orthogonalizes
        # separately, as nanochat's three matrices, unless GQA makes them unequal
        gqa = model.config.n_kv_head != model.config.n_head
        row_blocks = {} if gqa else {b.attn.c_attn.weight: 3 for b in model.transformer.h}
        optimizers.append(Muon(
            [{"params": matrices, "peak_lr": cfg.muon_lr, "logged_as": "lr_muon"}], lr=cfg.muon_lr,
            row_blocks=row_blocks, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=True,
            ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,  # torch's defaults
            ns_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32))
    return optimizers


AdamW = unguarded(torch.optim.AdamW)  # torch.optim.AdamW, without a slow first import


class Muon(unguarded(torch.optim.Muon)):
    """torch.optim.Muon's update of each matrix p: buf = lerp(buf, g, 1 - m), u = lerp(g, buf, m)
    (Nesterov), p *= 1 - lr wd, then p -= lr sqrt(max(1, rows / cols)) orthogonalize(u). Here the
    Newton-Schulz iteration runs in ns_dtype (torch's runs in bf16, which most x86 CPUs emulate far
    more slowly than fp32), batched over the matrices of one shape, and separately on each block of
    rows of a matrix in row_blocks. Without row_blocks, a step equals torch.optim.Muon's to rounding."""

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
            n_blocks = [self.row_blocks.get(p, 1) for p in params]

            # group is a default argument, so that the function never reads a later iteration's
            def newton_schulz(g: torch.Tensor, n_blocks: int, group: dict = group) -> torch.Tensor:
                return orthogonalize(g, group["ns_coefficients"], group["ns_steps"],
                                     group["eps"], self.ns_dtype, n_blocks)
            # Newton-Schulz needs each whole matrix, so sharded ones (FSDP) are shared out,
            # each orthogonalized on one process, with its rows handed back
            if any(is_dtensor(p) for p in params):
                from training.fsdp import each_on_one_process
                each = [lambda g, n=n: newton_schulz(g, n) for n in n_blocks]  # with its own blocks
                updates = each_on_one_process(updates, each)
            else:
                updates = by_shape(updates, n_blocks, newton_schulz)
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])  # decoupled weight decay
            for p, update, n in zip(params, updates, n_blocks, strict=True):
                # Muon's original lr rule: an orthogonal tall block has smaller entries than a square
                # one, so its lr is scaled by sqrt(rows / cols). A block has shape[0] / n rows, where
                # n is 3 for c_attn (its queries, keys and values are orthogonalized apart), else 1.
                # The quickstart's c_fc, 256 x 128, gets sqrt(2); c_attn's 128 x 128 blocks get 1.
                p.add_(update, alpha=-group["lr"] * math.sqrt(max(1.0, p.shape[0] / n / p.shape[1])))
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


def by_shape(matrices: list[torch.Tensor], n_blocks: list[int],
             fn: Callable[[torch.Tensor, int], torch.Tensor]) -> list[torch.Tensor]:
    """fn(m, n) for each matrix m of n row blocks, in the matrices' order, from one call of fn on
    the stack of all the matrices of one shape and n (fn takes dimension 0 as a batch)."""
    results: list[torch.Tensor | None] = [None] * len(matrices)
    shapes: dict[tuple[torch.Size, int], list[int]] = {}
    for i, key in enumerate(zip((m.shape for m in matrices), n_blocks, strict=True)):
        shapes.setdefault(key, []).append(i)
    for (_, n), indices in shapes.items():
        stacked = fn(torch.stack([matrices[i] for i in indices]), n)
        for i, result in zip(indices, stacked, strict=True):
            results[i] = result
    return results


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype, n_blocks: int = 1) -> torch.Tensor:
    """Approximately U V^T for g = U S V^T, by Muon's quintic Newton-Schulz iteration in dtype,
    on each matrix of g, (..., rows, cols), or on each of its n_blocks equal blocks of rows. It
    pushes every singular value towards 1 (to about 0.5 to 1.5, which trains as well as 1)."""
    a, b, c = coefficients
    x = g.to(dtype).reshape(-1, g.size(-2) // n_blocks, g.size(-1))  # (matrices x blocks, block rows, cols)
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
