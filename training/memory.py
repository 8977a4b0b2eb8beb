"""Whether a run fits in memory, so that one that does not fails before its first step.

Usage:
    from training.memory import check_memory, out_of_memory
    check_memory(cfg, vocab_size, device, dist)   # ConfigError naming what needs how much
    with out_of_memory(cfg, device, dist): ...    # the allocator's failure, in one line
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from machine import perf
from model import GPTConfig
from training import distributed
from training.config import ConfigError, TrainConfig


def min_activation_bytes(config: GPTConfig, tokens: int) -> int:
    """A lower bound on what one forward over `tokens` tokens keeps for its backward: 16
    bytes per layer and unit of width (a block keeps about ten tensors of the width, and
    four-wide ones, even in bf16 and compiled), and the logits in bf16. It is a lower bound
    (docs/reliability.md has measured steps), so a step that exceeds it cannot fit."""
    return tokens * (16 * config.n_layer * config.n_embd + 2 * config.vocab_size)


def parameter_counts(config: GPTConfig) -> tuple[int, int, int]:
    """The parameters of one block, of one block's matrices (the 2-D weights that Muon
    trains), and of the rest (the embeddings, the final norm and the head), counted from
    the shape as model.py builds the model. Building it, even on the meta device, would
    initialize its weights through torch's compiler, which is slow to import;
    tests/test_model.py checks that these counts equal a built model's."""
    C, hidden, kv = config.n_embd, config.mlp_hidden, 2 * config.n_kv_head * config.head_dim
    matrices = C * (C + kv) + C * C + 2 * C * hidden  # c_attn, c_proj, c_fc, mlp.c_proj
    biases = (C + kv) + C + hidden + C if config.bias else 0
    norm = C * (1 + config.bias) if config.norm == "layernorm" else 0  # RMSNorm has none
    positions = config.block_size * C if config.pos_embedding == "learned" else 0
    tables = config.vocab_size * C * (1 if config.tie_embeddings else 2)  # wte, lm_head
    tables += (config.vocab_size + 1) * C if config.bigram_embedding else 0  # and a row for "none"
    return matrices + biases + 2 * norm, matrices, tables + positions + norm


def state_bytes(config: GPTConfig, cfg: TrainConfig, world_size: int) -> int:
    """What one process holds besides activations: fp32 weights and gradients, AdamW's two
    moments or Muon's one (momentum), each 1/N under FSDP, plus the largest group FSDP
    gathers whole for a moment (a block, or the root's embeddings and head: its weights and
    their gradients)."""
    block, matrices, root = parameter_counts(config)
    params = config.n_layer * block + root
    muon = config.n_layer * matrices if cfg.optimizer == "muon" else 0
    total = 16 * params - 4 * muon  # weights, gradients and two moments, or one for Muon
    return total if cfg.parallel != "fsdp" else total // world_size + 8 * max(root, block)


def check_memory(cfg: TrainConfig, vocab_size: int, device: torch.device,
                 dist: distributed.Dist) -> None:
    """Refuse a run whose weights and one micro-batch cannot fit in memory, before any step,
    because on a CPU it would swap the machine to a standstill rather than fail. A fine-tuned
    model's shape is its folder's, known only once loaded, so init_from is not checked.
    Rank 0's verdict holds for all, because processes that start apart would see different
    free memory, and one refusing alone would leave the others waiting in a collective."""
    distributed.from_main(lambda: check_fits(cfg, vocab_size, device, dist), dist)


def check_fits(cfg: TrainConfig, vocab_size: int, device: torch.device,
               dist: distributed.Dist) -> None:
    if cfg.init_from:
        return
    config = cfg.model_config(vocab_size)
    tokens = cfg.batch_size * cfg.model.block_size
    # torchrun's processes on one machine share its RAM (perf.check_room counts them there)
    perf.check_room("this run", {
        "the weights, gradients and optimizer state": state_bytes(config, cfg, dist.world_size),
        f"the activations of batch_size {cfg.batch_size} x block_size {cfg.model.block_size}":
            min_activation_bytes(config, tokens)}, device,
        fix(cfg, dist), ConfigError, dist.local_world_size)


def fix(cfg: TrainConfig, dist: distributed.Dist) -> str:
    """What to lower, and where sharding the model would help: several processes that each
    hold all of it."""
    return ("lower batch_size (raising gradient_accumulation_steps keeps the tokens per step) "
            "or the model's size" + (", or shard it across the processes with --parallel fsdp"
                                     if dist.enabled and cfg.parallel != "fsdp" else ""))


def out_of_memory(cfg: TrainConfig, device: torch.device,
                  dist: distributed.Dist) -> AbstractContextManager[None]:
    """A step that the check let through and the allocator then failed, in one line naming
    the batch, what bounds the memory, and the fix (machine.perf.out_of_memory)."""
    return perf.out_of_memory(f"training with batch_size {cfg.batch_size} x block_size "
                              f"{cfg.model.block_size}", device, fix(cfg, dist),
                              lambda message: ConfigError(message, everywhere=False))
