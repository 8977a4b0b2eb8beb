"""The optimizers that update the model at every training step.

Usage:
    from training.optimizer import configure_optimizers
    optimizers = configure_optimizers(model, cfg, device, dtype)  # one or two optimizers

Two recipes, chosen by TrainConfig.optimizer:
- "adamw", GPT-2's: AdamW at learning_rate, and at embedding_lr on the lookup tables (wte
  when the head is untied, and the bigram table wtb).
- "muon", nanochat's and the modded-nanogpt speedruns': Muon at muon_lr on the 2-D weights
  inside the blocks, and AdamW on the rest: the lookup tables at embedding_lr, and the head,
  wpe, biases and norm gains at learning_rate. Muon orthogonalizes each matrix's smoothed
  gradient, so that every direction of the update moves at the same rate, which suits the
  hidden matrices and not the embeddings, whose rows are looked up one at a time. Its code
  is in training/muon.py, imported only by a run that uses it.

Both apply decoupled weight decay, scaled by their own lr, to the weight matrices, but not to
biases and gains, which a pull towards zero only hurts, nor to the lookup tables at
embedding_lr (see configure_optimizers); the position table wpe is decayed, as in nanoGPT.
Each group follows train.py's schedule (get_lr_scale) as a fraction of its peak_lr.
"""

from __future__ import annotations

import inspect

import torch

from model import GPT
from training.config import TrainConfig
from training.distributed import is_dtensor
from training.unguarded import Unguarded


def muon_parameters(model: GPT) -> set[torch.nn.Parameter]:
    """The matrices that Muon trains: the 2-D weights inside the transformer blocks."""
    return {p for p in model.transformer.h.parameters() if p.dim() == 2 and p.requires_grad}


def configure_optimizers(model: GPT, cfg: TrainConfig, device: torch.device,
                         dtype: torch.dtype = torch.float32) -> list[torch.optim.Optimizer]:
    """The recipe's optimizers, each param group tagged with its peak lr ("peak_lr"). dtype
    is the run's compute dtype; Muon orthogonalizes in bf16 only when the run is in bf16."""
    trained = [p for p in model.parameters() if p.requires_grad]
    hidden = muon_parameters(model) if cfg.optimizer == "muon" else set()
    # An untied token table and the bigram table are lookups whose rows move only where their
    # tokens appear. They learn faster with a far larger lr (as in nanochat), and without weight
    # decay, which grows with the lr and would pull their rows to zero. The head, which every
    # position uses whole, and wpe, whose every row trains at every step, stay with the rest.
    tables = [] if model.config.tie_embeddings else [model.transformer.wte.weight]
    tables += [model.transformer.wtb.weight] if "wtb" in model.transformer else []
    rest = [p for p in trained if p not in hidden and all(p is not t for t in tables)]
    adamw_groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay,
         "peak_lr": cfg.learning_rate},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0,
         "peak_lr": cfg.learning_rate},
    ]
    if tables := [t for t in tables if t.requires_grad]:
        adamw_groups.append({"params": tables, "weight_decay": 0.0,
                             "peak_lr": cfg.embedding_lr or cfg.learning_rate})
    # the fused kernel updates all plain tensors in one pass; FSDP's sharded ones cannot use it
    sharded = any(is_dtensor(p) for p in trained)
    optimizers: list[torch.optim.Optimizer] = [AdamW(
        adamw_groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
        fused=device.type in ("cuda", "cpu") and not sharded)]
    if hidden:  # Muon's code is imported only by a run that trains with it
        from training.muon import Muon
        # in the model's order, because a checkpoint's optimizer state is matched by position
        matrices = [p for p in trained if p in hidden]
        # c_attn's rows are the queries', keys' and values' projections, which Muon orthogonalizes
        # separately, as nanochat's three matrices, unless GQA makes them unequal
        blocks = {b.attn.c_attn.weight: 3 for b in model.transformer.h if b.attn.n_kv_head == b.attn.n_head}
        optimizers.append(Muon(
            [{"params": matrices, "peak_lr": cfg.muon_lr}], lr=cfg.muon_lr, row_blocks=blocks,
            weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=True,
            ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,  # torch's defaults
            ns_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32))
    return optimizers


class AdamW(Unguarded, torch.optim.AdamW):
    """torch.optim.AdamW without the guards; its step runs in no_grad, as torch's wrapper ran it."""

    step = torch.no_grad()(inspect.unwrap(torch.optim.AdamW.step))
