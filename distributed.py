"""Data-parallel training: which process this is, and the few collectives the loop needs.

Usage:
    torchrun --standalone --nproc_per_node=2 train.py --config config/quickstart.toml

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and MASTER_ADDR/MASTER_PORT); without them
this is a single process and every helper here is a no-op. Under torchrun the processes
form a group, even a group of one (as in nanoGPT), so that one GPU runs the same code as
eight. NCCL on CUDA, gloo on the CPU.
If one process dies, torchrun ends the others, so a crash never leaves the run hanging.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    enabled: bool = False  # launched by torchrun: in a process group

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
                int(os.environ["WORLD_SIZE"]), enabled=True)


def setup(use_cuda: bool) -> Dist:
    """Join the process group torchrun describes in the environment, if any."""
    info = environment()
    if not info.enabled:
        return info
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return info


def teardown(info: Dist) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: torch.Tensor, info: Dist) -> torch.Tensor:
    """The element-wise sum of `values` over all processes (a copy; the input is untouched)."""
    total = values.clone()
    if info.enabled:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def any_true(flag: bool, info: Dist, device: torch.device) -> bool:
    """True on every process if it is true on any: keeps all processes leaving together."""
    if not info.enabled:
        return flag
    return bool(all_sum(torch.tensor([float(flag)], device=device), info).item() > 0)


def from_main(make: Callable[[], Any], info: Dist) -> Any:
    """Rank 0 calls make(); every process returns its value, or raises its error. Without
    the error in the broadcast, a failure on rank 0 alone (a run folder it cannot take, data
    it cannot prepare) would leave the others in the next collective until gloo gives up
    with a traceback. An error raised here on another rank has `from_main` set: rank 0
    reports it."""
    if not info.enabled:
        return make()
    box: list[Any] = [None, None]  # (value, error)
    if info.is_main:
        try:
            box[0] = make()
        except Exception as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        if not info.is_main:
            box[1].from_main = True
        raise box[1]
    return box[0]
