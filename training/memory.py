"""Whether a run fits in memory, so that one that does not fails before its first step.

Usage:
    from training.memory import check_memory, out_of_memory
    check_memory(cfg, vocab_size, device, dist)   # ConfigError naming what needs how much
    with out_of_memory(cfg, device, dist): ...    # the allocator's failure, in one line
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from machine.perf import memory_room
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
    if cfg.parallel != "fsdp":
        return total
    return total // world_size + 8 * max(root, block)


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
    room = memory_room(device)
    if room is None or cfg.init_from:
        return
    available, bound = room
    config = cfg.model_config(vocab_size)
    weights = state_bytes(config, cfg, dist.world_size)
    activations = min_activation_bytes(config, cfg.batch_size * cfg.model.block_size)
    # torchrun's processes on one machine share its RAM; a GPU is each process's own, and so
    # is a process's ulimit -v
    shared = device.type == "cpu" and bound == "free"
    processes = dist.local_world_size if shared else 1
    need = processes * (weights + activations)
    if need > available:
        parts = (f"{weights / 1e9:,.1f} for the weights, gradients and optimizer state, "
                 f"{activations / 1e9:,.1f} for the activations of batch_size {cfg.batch_size} "
                 f"x block_size {cfg.model.block_size}")
        if processes > 1:
            parts = f"{processes} processes, each {parts}"
        raise ConfigError(f"this run needs at least {need / 1e9:,.1f} GB ({parts}), but "
                          f"{device.type} has {available / 1e9:,.1f} GB {bound}; lower batch_size "
                          f"(raising gradient_accumulation_steps keeps the tokens per step) or "
                          f"the model's size{shard_hint(cfg, dist)}")


def shard_hint(cfg: TrainConfig, dist: distributed.Dist) -> str:
    """Where sharding the model would help: several processes that each hold all of it."""
    return (", or shard it across the processes with --parallel fsdp"
            if dist.enabled and cfg.parallel != "fsdp" else "")


@contextmanager
def out_of_memory(cfg: TrainConfig, device: torch.device, dist: distributed.Dist) -> Iterator[None]:
    """A run that the check let through and the allocator then failed (the bound above is a
    lower one, and other processes take memory too) ends as the check's refusal would: one
    line naming the batch, what bounds the memory, and the fix, not the allocator's trace."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is one, and a CPU raises a plain one
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        room = memory_room(device)
        bound = f", with {room[0] / 1e9:,.1f} GB {room[1]}" if room else ""
        raise ConfigError(f"training with batch_size {cfg.batch_size} x block_size "
                          f"{cfg.model.block_size} ran out of memory on {device.type}{bound}; "
                          f"lower batch_size (raising gradient_accumulation_steps keeps the "
                          f"tokens per step) or the model's size{shard_hint(cfg, dist)}",
                          everywhere=False) from None
