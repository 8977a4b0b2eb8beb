"""The optimizers and the learning-rate schedule that training steps with.

Usage:
    from optimizer import configure_optimizers, lr_multiplier, set_lr
    optimizers = configure_optimizers(model, cfg, device)   # a list: one or two optimizers
    set_lr(optimizers, lr_multiplier(it, cfg))               # before each step

Two recipes, chosen by TrainConfig.optimizer:
- "adamw", GPT-2's: AdamW on every parameter at learning_rate.
- "muon", nanochat's and the modded-nanogpt speedruns': Muon on the 2-D weights inside the
  blocks (attention's qkv and output projections, the MLP's two layers) at muon_lr, and
  AdamW at learning_rate on the rest: the token embedding (which is also the tied output
  head), the position embedding, the biases and the LayerNorm gains. Muon orthogonalizes
  each matrix's momentum, so every direction of the update moves at the same rate; that is
  what suits the hidden matrices and not the embeddings, whose rows are looked up one at a
  time.

Weight decay, in both recipes: weight_decay on the matrices (Linear weights, embeddings),
none on biases and LayerNorm gains, whose pull towards zero only hurts. Both optimizers
decay decoupled and scaled by their own learning rate, so Muon's larger rate decays its
matrices faster for the same weight_decay.

Every group follows one schedule: a linear warmup, then a cosine decay to min_lr /
learning_rate of its peak.
"""

from __future__ import annotations

import math

import torch

from model import GPT
from train_config import TrainConfig


def muon_parameters(model: GPT) -> set[torch.nn.Parameter]:
    """The matrices that Muon trains: the 2-D weights inside the transformer blocks."""
    return {p for p in model.transformer.h.parameters() if p.dim() == 2 and p.requires_grad}


def configure_optimizers(model: GPT, cfg: TrainConfig,
                         device: torch.device) -> list[torch.optim.Optimizer]:
    """The recipe's optimizers, each param group tagged with its peak lr for set_lr."""
    trained = [p for p in model.parameters() if p.requires_grad]
    hidden = muon_parameters(model) if cfg.optimizer == "muon" else set()
    rest = [p for p in trained if p not in hidden]
    adamw_groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    for group in adamw_groups:
        group["peak_lr"] = cfg.learning_rate
    # the fused kernel does the whole update in one pass over the parameters
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(
        adamw_groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
        fused=device.type in ("cuda", "cpu"))]
    if hidden:
        # the model's order, not the set's: a checkpoint's optimizer state is matched to
        # parameters by position
        matrices = [p for p in trained if p in hidden]
        optimizers.append(torch.optim.Muon(
            [{"params": matrices, "peak_lr": cfg.muon_lr}], lr=cfg.muon_lr,
            weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum))
    return optimizers


def lr_multiplier(it: int, cfg: TrainConfig) -> float:
    """The schedule as a fraction of each group's peak lr: linear warmup to 1, then cosine
    decay to min_lr / learning_rate at lr_decay_iters (default max_iters)."""
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return (it + 1) / (cfg.warmup_iters + 1)
    floor = cfg.min_lr / cfg.learning_rate if cfg.learning_rate > 0 else 1.0
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return floor
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    return floor + coeff * (1.0 - floor)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
