"""Data-parallel training: which process this is, the few collectives the loop needs, and
the two ways to share a model (parallel = "ddp" or "fsdp").

Usage:
    torchrun --standalone --nproc_per_node=2 train.py --config config/quickstart.toml
    torchrun --standalone --nproc_per_node=2 train.py --config ... --parallel fsdp

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and MASTER_ADDR/MASTER_PORT); without them
this is a single process and every helper here is a no-op. Under torchrun the processes
form a group, even a group of one (as in nanoGPT), so that one GPU runs the same code as
eight. NCCL on CUDA, gloo on the CPU.
If one process dies, torchrun ends the others, so a crash never leaves the run hanging.

DDP keeps the whole model, its gradients and its optimizer state on every process and
averages gradients. FSDP (torch's fully_shard) keeps 1/N of each on each process, gathers a
block's weights for its forward and backward, and reduce-scatters its gradients: the
memory per process falls with N, for more communication (docs/distributed.md). Under FSDP
each process saves its own shards (training/checkpoints.py); `sharded_like` hands each
process its part of a whole tensor (the initial weights, a plain checkpoint's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from machine.errors import UserError
from model import GPT, GPTConfig


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    enabled: bool = False  # launched by torchrun: in a process group
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


def setup(use_cuda: bool) -> Dist:
    """Join the process group torchrun describes in the environment, if any."""
    info = environment()
    if not info.enabled:
        return info
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return info


def teardown(info: Dist, finished: bool) -> None:
    """Leave the process group. After a run that finished (not one that failed, whose peers
    may be gone) only once every process is done with it, so that none tears its end down
    while another still waits on it."""
    if info.enabled and dist.is_initialized():
        if finished:
            dist.barrier()
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


class FailedOnMain(UserError):
    """What the other processes raise when rank 0's part of the work failed: rank 0
    reports the error; they leave with its exit code, saying nothing."""
    everywhere = True

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.label = getattr(error, "label", "error")
        self.exit_code = getattr(error, "exit_code", 1)


def from_main(make: Callable[[], Any], info: Dist) -> Any:
    """Rank 0 calls make(); every process returns its value, or raises: rank 0 its error,
    the others FailedOnMain. Without the error in the broadcast, a failure on rank 0 alone
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


# --- FSDP: a model sharded across the processes --------------------------------------------

def shard_model(config: GPTConfig, device: torch.device, param_dtype: torch.dtype | None,
                compile: bool, base: dict[str, Any] | None = None) -> GPT:
    """The model built on the meta device, each block sharded with fully_shard and the rest
    (the embeddings, the final norm, the head) as the root's group; then each process makes
    its shards and fills them from the full initial values, or the base model's weights
    (weights.lazy.Lazy: read one at a time), one parameter at a time, so no process ever
    holds the whole model. param_dtype (a GPU's bf16) is FSDP's mixed precision: weights
    gathered in it, gradients reduced in fp32. compile compiles each block before it is
    sharded, as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32
                                  if param_dtype else None)
    with torch.device("meta"):
        model = GPT(config)
    for block in model.transformer.h:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    model.init_weights(lambda param, value: param.copy_(sharded_like(value, param)))
    if base is not None:  # the drawn values are replaced: the base's, each process its rows
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(sharded_like(base[name].load().to(param.dtype), param))
    return model


# FSDP's modules take most of a second to import: every command would pay it at its
# start. Nothing can be sharded before they are imported, so the checks look them up.

def is_sharded(model: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_dtensor(t: object) -> bool:
    """Whether t is sharded (a DTensor, FSDP's parameters and their state)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out as `like`: this process's shard if `like` is sharded (every
    process has the full value and takes its part; no communication), else as it is. A
    value that is sharded already (read from a sharded checkpoint) stays as it is."""
    if not is_dtensor(like) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor; a plain one as it is."""
    return t.to_local() if is_dtensor(t) else t


def first_of_any(value: Any, info: Dist) -> Any:
    """The first value that is not None among the processes' (rank order), on every
    process: what one process found (a NaN in its shard), all of them act on."""
    if not info.enabled:
        return value
    values: list[Any] = [None] * info.world_size
    dist.all_gather_object(values, value)
    return next((v for v in values if v is not None), None)


def sharded_optimizer_state(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A full optimizer state_dict (as a checkpoint holds it) laid out for `optimizer`,
    whose parameters may be sharded: each tensor the shape of its parameter becomes this
    process's shard; step counts stay as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {**state, "state": {
        index: {key: sharded_like(value, params[index])
                if isinstance(value, torch.Tensor) and value.shape == params[index].shape
                else value for key, value in entry.items()}
        for index, entry in state["state"].items()}}


def gradient_sync(model: torch.nn.Module, info: Dist, sync: bool) -> AbstractContextManager:
    """Whether this backward reduces gradients across processes: only the last of a step's
    micro-batches needs to; the earlier reductions would be wasted work."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    return model.no_sync() if info.enabled and not sync else nullcontext()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded result (FSDP's gradient norm) as one tensor; a plain one as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def each_on_one_process(tensors: list[torch.Tensor],
                        fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """fn of each whole tensor, laid out as the tensor (sharded by rows: FSDP's Shard(0)):
    tensor i is gathered whole on process i % N alone, which computes fn of it, and each
    process gets its rows of the result back. Each process does 1/N of the work and holds
    one whole tensor at most, where gathering every tensor on every process would do all the
    work N times over. The tensors go in rounds of N, one per process, computed at once, as
    modded-nanogpt distributes Muon."""
    from torch.distributed.tensor import DTensor
    world, rank = dist.get_world_size(), dist.get_rank()
    results: list[torch.Tensor] = []
    for start in range(0, len(tensors), world):
        round_ = tensors[start:start + world]
        pieces = [padded_shard(t, world) for t in round_]
        inbox = [torch.empty_like(pieces[rank]) for _ in range(world)] if rank < len(round_) else None
        waits = [dist.gather(piece, inbox if owner == rank else None, dst=owner, async_op=True)
                 for owner, piece in enumerate(pieces)]
        for work in waits:
            work.wait()
        outbox = None
        if inbox is not None:
            rows = round_[rank].shape[0]
            whole = fn(torch.cat(inbox)[:rows]).to(inbox[0].dtype)
            outbox = list(torch.cat([whole, whole.new_zeros(inbox[0].shape[0] * world - rows,
                                                            *whole.shape[1:])]).chunk(world))
        backs = [torch.empty_like(piece) for piece in pieces]
        waits = [dist.scatter(back, outbox if owner == rank else None, src=owner, async_op=True)
                 for owner, back in enumerate(backs)]
        for work in waits:
            work.wait()
        for t, back in zip(round_, backs, strict=True):
            mine = back[:t.to_local().shape[0]]
            results.append(DTensor.from_local(mine, t.device_mesh, t.placements, run_check=False,
                                              shape=t.shape, stride=t.stride()))
    return results


def padded_shard(t: torch.Tensor, world: int) -> torch.Tensor:
    """This process's rows of a tensor sharded by rows, padded with zeros to the largest
    shard's count (ceil(rows / N): torch.chunk's, which FSDP uses), as gather and scatter
    need equal pieces."""
    rows = -(-t.shape[0] // world)
    part = t.to_local()
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
