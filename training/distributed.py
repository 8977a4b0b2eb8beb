"""Several processes under torchrun: which process this is, and the few collectives that
training needs. training/fsdp.py shards a model across them (parallel = "fsdp").

Usage:
    from training import distributed
    with distributed.process_group(cfg) as dist:   # Dist(rank, world_size, ..., sharded)
        total = distributed.all_sum(values, dist)
        folder = distributed.from_main(take_folder, dist)   # rank 0 does it, all get it

Without torchrun's RANK, LOCAL_RANK and WORLD_SIZE this is one process, and every helper
here does nothing; under torchrun they call training/torchrun.py (the process group, rank
0's result shared, DDP), which a single process never imports.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from training.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    enabled: bool = False  # launched by torchrun, and so in a process group
    local_world_size: int = 1  # processes on this machine, which share its CPUs and RAM
    sharded: bool = False  # parallel = fsdp: each process keeps only its shards of the model

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, logs to TensorBoard and writes checkpoints."""
        return self.rank == 0


def environment() -> Dist:
    """This process's place as torchrun's environment describes it; no process group is
    needed to ask, so the command line can know before training whether it reports."""
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        return Dist()
    return Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                int(os.environ["WORLD_SIZE"]), enabled=True,
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@contextmanager
def process_group(cfg: TrainConfig) -> Iterator[Dist]:
    """Join the process group that torchrun describes, if any, for as long as the block
    runs (training/torchrun.joined), once check_parallel has accepted the settings; a single
    process gets Dist() and joins nothing."""
    info = environment()
    sharded = check_parallel(cfg, info)
    if not info.enabled:
        yield info
        return
    from training.torchrun import joined
    with joined(cfg.device, info.local_rank):
        yield replace(info, sharded=sharded)


def check_parallel(cfg: TrainConfig, info: Dist) -> bool:
    """Whether this run shards its model (FSDP); ConfigError where the processes and the
    settings do not fit together."""
    if cfg.gradient_accumulation_steps % info.world_size != 0:
        raise ConfigError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) "
                          f"must be divisible by the number of processes ({info.world_size})")
    if cfg.parallel != "fsdp":
        return False
    if not info.enabled:
        raise ConfigError("parallel = fsdp shards the model across torchrun's processes; "
                          "launch with torchrun --nproc_per_node=N, or drop --parallel")
    if cfg.dtype == "float16":
        raise ConfigError("parallel = fsdp trains in float32 or bfloat16, because float16's "
                          "loss scaling is not wired for sharded gradients; use --dtype bfloat16")
    return True


def all_sum(values: torch.Tensor, info: Dist) -> torch.Tensor:
    """The element-wise sum of `values` over all processes (a copy; the input is untouched)."""
    total = values.clone()
    if info.enabled:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def largest(value: int, info: Dist, device: torch.device) -> int:
    """The largest of every process's value, the same on all, so that all processes act alike."""
    total = torch.tensor([value], device=device)
    if info.enabled:
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return int(total.item())


def from_main(make: Callable[[], Any], info: Dist) -> Any:
    """Rank 0 calls make(), and every process returns its value or raises: rank 0 its error,
    the others FailedOnMain (training/torchrun.broadcast_from_main says why). A single
    process just calls it."""
    if not info.enabled:
        return make()
    from training.torchrun import broadcast_from_main
    return broadcast_from_main(make, info.is_main)


def sync_gradients(model: torch.nn.Module, now: bool) -> None:
    """Whether the next backward pass reduces the gradients across the processes, which only
    a step's last micro-batch needs to. DDP reads the flag that no_sync() sets, as nanoGPT does."""
    if is_sharded(model):
        model.set_requires_gradient_sync(now)
    else:
        model.require_backward_grad_sync = now


# FSDP's modules are slow to import, and every command would pay for that at its
# start. Nothing can be sharded before they are imported, so these checks look them up.

def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model is sharded across the processes (FSDP)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_dtensor(t: object) -> bool:
    """Whether t is sharded (a DTensor, as FSDP's parameters and their state are)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded result (FSDP's gradient norm) as one tensor; a plain one as it is."""
    return t.full_tensor() if is_dtensor(t) else t
