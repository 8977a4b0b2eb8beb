"""Whether a run fits in memory: refused before its first step, not swapped to a standstill.

Usage:
    from training.memory import check_memory, steps_in_memory
    check_memory(cfg, vocab_size, device, dist)   # ConfigError naming what needs how much
    with steps_in_memory(cfg, device): ...        # the allocator's failure, in one line
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from machine.perf import memory_room
from model import GPT, GPTConfig
from training import distributed
from training.config import ConfigError, TrainConfig


def min_activation_bytes(config: GPTConfig, tokens: int) -> int:
    """A lower bound on what one forward over `tokens` tokens keeps for its backward: 16
    bytes per layer and unit of width (a block keeps about ten tensors of the width, and
    four-wide ones, even in bf16 and compiled), and the logits in bf16. Measured steps take
    2.4-4.2x as much (docs/reliability.md), so a step this bound does not fit cannot fit."""
    return tokens * (16 * config.n_layer * config.n_embd + 2 * config.vocab_size)


def check_memory(cfg: TrainConfig, vocab_size: int, device: torch.device,
                 dist: distributed.Dist) -> None:
    """Refuse a run whose weights and one micro-batch cannot fit in memory, before any step:
    on a CPU it would swap the machine to a standstill rather than fail. A fine-tuned
    model's shape is its folder's, known only once loaded, so init_from is not checked."""
    room = memory_room(device)
    if room is None or cfg.init_from:
        return
    available, bound = room
    config = cfg.model_config(vocab_size)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # allocates nothing
        params = GPT(config).num_params(non_embedding=False)
    # fp32 weights, their gradients and at least one moment (Muon's momentum; AdamW keeps
    # two), of all of which FSDP keeps a shard in each process
    weights = 12 * params // (dist.world_size if cfg.parallel == "fsdp" else 1)
    activations = min_activation_bytes(config, cfg.batch_size * cfg.model.block_size)
    # torchrun's processes on one machine share its RAM; a GPU is each process's own
    processes = dist.local_world_size if device.type == "cpu" else 1
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
                          f"the model's size")


@contextmanager
def steps_in_memory(cfg: TrainConfig, device: torch.device) -> Iterator[None]:
    """A step that the check let through and the allocator then failed (the bound above is
    a lower one, and other processes take memory too) ends as the check's refusal would: one
    line naming the batch, what bounds the memory, and the fix, not the allocator's trace."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is one; a CPU's is a plain one
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        room = memory_room(device)
        bound = f", with {room[0] / 1e9:,.1f} GB {room[1]}" if room else ""
        raise ConfigError(f"a step of batch_size {cfg.batch_size} x block_size "
                          f"{cfg.model.block_size} ran out of memory on {device.type}{bound}; "
                          f"lower batch_size (raising gradient_accumulation_steps keeps the "
                          f"tokens per step) or the model's size") from None
