"""What only a run under torchrun does: join the process group that torchrun describes,
share rank 0's result (or its failure) with the other processes, and wrap the model in DDP.
training/distributed.py imports it where a process finds itself under torchrun, because a
single process needs none of it; training/fsdp.py shards a model across the processes.

Usage:
    torchrun --standalone --nproc_per_node=2 train.py config/quickstart.toml

    from training import torchrun
    with torchrun.joined("auto", local_rank):                   # torchrun's LOCAL_RANK
        value = torchrun.broadcast_from_main(make, rank == 0)   # rank 0 makes it, all get it
        model = torchrun.ddp(model, device)

The processes form a group, even a group of one (as in nanoGPT), over NCCL on CUDA and gloo
on the CPU; if one dies, torchrun ends the others. DDP, the default, keeps the whole model
on every process and averages the gradients in backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from machine.device import resolve_device
from machine.errors import UserError


@contextmanager
def joined(device: str, local_rank: int) -> Iterator[None]:
    """Be in the process group for as long as the block runs. After a block that finished
    (not one that failed, whose peers may be gone) the processes wait for each other before
    leaving, so that none tears its end down while another still waits on it."""
    use_cuda = resolve_device(device, local_rank).type == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    finished = False
    try:
        yield
        finished = True
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


class FailedOnMain(UserError):
    """What the other processes raise when rank 0's part of the work failed. Rank 0
    reports the error, and the others leave with its exit code, saying nothing."""
    everywhere = True

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.label = getattr(error, "label", "error")
        self.exit_code = getattr(error, "exit_code", 1)


def broadcast_from_main(make: Callable[[], Any], is_main: bool) -> Any:
    """Rank 0 calls make(), and every process returns its value or raises (rank 0 its
    error, the others FailedOnMain). Without the error in the broadcast, a failure on rank 0 alone
    (a run folder it cannot take, data it cannot prepare) would leave the others in the
    next collective until gloo gives up with a traceback."""
    box: list[Any] = [None, None]  # (value, error)
    if is_main:
        try:
            box[0] = make()
        except Exception as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        if is_main:
            raise box[1]
        raise FailedOnMain(box[1])
    return box[0]


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model in DDP, which averages the gradients across the processes in the backward
    pass, keeping them in its buckets rather than in a second copy beside them."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)
