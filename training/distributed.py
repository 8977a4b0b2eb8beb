"""Several processes under torchrun: which process this is, and the few collectives that
training needs. training/fsdp.py shards a model across them (parallel = "fsdp").

Usage:
    torchrun --standalone --nproc_per_node=2 train.py config/quickstart.toml

    from training import distributed
    with distributed.process_group("auto") as dist:   # Dist(rank, world_size, ...)
        total = distributed.all_sum(values, dist)
        folder = distributed.from_main(take_folder, dist)   # rank 0 does it, all get it

Without torchrun's RANK, LOCAL_RANK and WORLD_SIZE this is one process, and every helper
here does nothing. Under torchrun the processes form a group, even a group of one (as in
nanoGPT), over NCCL on CUDA and gloo on the CPU; if one dies, torchrun ends the others. DDP, the
default, keeps the whole model on every process and averages the gradients in backward.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from machine.device import resolve_device
from machine.errors import UserError
from training.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    enabled: bool = False  # launched by torchrun, and so in a process group
    local_world_size: int = 1  # processes on this machine, which share its CPUs and RAM

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
def process_group(device: str) -> Iterator[Dist]:
    """Join the process group that torchrun describes, if any, for as long as the block
    runs. After a block that finished (not one that failed, whose peers may be gone) the
    processes wait for each other before leaving, so that none tears its end down while
    another still waits on it."""
    info = environment()
    if not info.enabled:
        yield info
        return
    use_cuda = resolve_device(device, info.local_rank).type == "cuda"
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    finished = False
    try:
        yield info
        finished = True
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


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


def any_true(flag: bool, info: Dist, device: torch.device) -> bool:
    """True on every process if it is true on any, so that all processes leave together."""
    if not info.enabled:
        return flag
    return bool(all_sum(torch.tensor([float(flag)], device=device), info).item() > 0)


class FailedOnMain(UserError):
    """What the other processes raise when rank 0's part of the work failed. Rank 0
    reports the error, and the others leave with its exit code, saying nothing."""
    everywhere = True

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.label = getattr(error, "label", "error")
        self.exit_code = getattr(error, "exit_code", 1)


def from_main(make: Callable[[], Any], info: Dist) -> Any:
    """Rank 0 calls make(), and every process returns its value or raises (rank 0 its
    error, the others FailedOnMain). Without the error in the broadcast, a failure on rank 0 alone
    (a run folder it cannot take, data it cannot prepare) would leave the others in the
    next collective until gloo gives up with a traceback."""
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
        if info.is_main:
            raise box[1]
        raise FailedOnMain(box[1])
    return box[0]


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model in DDP, which averages the gradients across the processes in the backward
    pass, keeping them in its buckets rather than in a second copy beside them."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


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
