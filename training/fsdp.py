"""A model sharded across torchrun's processes (parallel = "fsdp"), and the sharded
tensors that come with it: torch's fully_shard keeps 1/N of the weights, gradients and
optimizer state on each process, gathers a block's weights for its forward and backward,
and reduce-scatters its gradients. The memory per process falls with N, at the cost
of more communication (docs/distributed.md). Imported only by a run that shards.

Usage:
    torchrun --standalone --nproc_per_node=2 train.py --config ... --parallel fsdp

    from training.fsdp import shard_model, sharded_like
    model = shard_model(config, device, param_dtype, compile, base)  # each process its own shards
    param.copy_(sharded_like(full_value, param))                     # this process's part

Each process saves and reads its own shards of a checkpoint (write_sharded and
fill_from_shards, in weights/sharded.py's format); `sharded_like` hands each process its
part of a whole tensor (the initial weights, or a plain checkpoint's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from model import GPT, GPTConfig, rope_tables
from training import distributed
from training.distributed import Dist, is_dtensor
from weights import sharded
from weights.checkpoint import CheckpointError, TrainState


def shard_model(config: GPTConfig, device: torch.device, param_dtype: torch.dtype | None,
                compile: bool, base: dict[str, Any] | None = None) -> GPT:
    """The model built on the meta device, each block sharded with fully_shard and the rest
    (the embeddings, the final norm, the head) as the root's group; then each process makes
    its shards and fills them from the full initial values, or the base model's weights
    (weights.lazy.Lazy, read one at a time), one parameter at a time, so no process ever
    holds the whole model. param_dtype (a GPU's bf16) is FSDP's mixed precision: the weights
    are gathered in it, the gradients reduced in fp32. compile compiles each block before it is
    sharded, as torchtitan does."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32
                                  if param_dtype else None)
    with torch.device("meta"):
        model = GPT(config)  # shapes only: nothing is allocated, and init_weights draws nothing
    for block in model.transformer.h:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    with torch.no_grad():
        with WholeValues():  # the same values as a model built whole, from the same draws
            model.init_weights()
        if config.pos_embedding == "rope":  # computed, not drawn, and empty after to_empty
            cos, sin = rope_tables(config)
            model.rope_cos.copy_(cos)
            model.rope_sin.copy_(sin)
        if base is not None:  # the base's values replace the drawn ones, one parameter at a time
            for name, param in model.named_parameters():
                param.copy_(sharded_like(base[name].load().to(param.dtype), param))
    return model


class WholeValues(TorchFunctionMode):
    """Within this block, an in-place fill of a sharded parameter (GPT.init_weights' normal_,
    zero_ and fill_) fills a whole tensor on the CPU, as it would in a model built whole, and
    copies this process's shard of it into the parameter. One whole parameter is held at a time."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.normal_, torch.Tensor.zero_, torch.Tensor.fill_) and is_dtensor(args[0]):
            whole = func(torch.empty(args[0].shape), *args[1:], **kwargs)
            return args[0].copy_(sharded_like(whole, args[0]))
        return func(*args, **kwargs)


def sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out as `like`: this process's shard if `like` is sharded (every
    process has the full value and takes its part, with no communication), else as it is. A
    value that is sharded already (read from a sharded checkpoint) stays as it is."""
    if not is_dtensor(like) or is_dtensor(value):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor; a plain one as it is."""
    return t.to_local() if is_dtensor(t) else t


def first_of_any(value: Any, info: Dist) -> Any:
    """The first value that is not None among the processes' (rank order), on every
    process, so that all of them act on what one found (a NaN in its shard)."""
    values: list[Any] = [None] * info.world_size
    dist.all_gather_object(values, value)
    return next((v for v in values if v is not None), None)


def laid_out_like(saved: TrainState, model: GPT,
                  optimizers: list[torch.optim.Optimizer]) -> TrainState:
    """A state of whole tensors (a plain checkpoint's) laid out as this process holds the
    model and its optimizers: each tensor becomes its shard."""
    current = model.state_dict()
    return replace(saved, model={k: sharded_like(v, current[k]) for k, v in saved.model.items()},
                   optimizer=[sharded_optimizer_state(state, opt)
                              for state, opt in zip(saved.optimizer, optimizers, strict=True)])


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


def each_on_one_process(tensors: list[torch.Tensor],
                        fns: list[Callable[[torch.Tensor], torch.Tensor]]) -> list[torch.Tensor]:
    """fns[i] of each whole tensor i, laid out as the tensor (sharded by rows, FSDP's Shard(0)):
    tensor i is gathered whole on process i % N alone, which computes fns[i] of it, and each
    process gets its rows of the result back. Each process does 1/N of the work and holds
    one whole tensor at most, where gathering every tensor on every process would do all the
    work N times over. The tensors go in rounds of N, one per process, computed at once, as
    modded-nanogpt distributes Muon."""
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
            whole = fns[start + rank](torch.cat(inbox)[:rows]).to(inbox[0].dtype)
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
    shard's count (ceil(rows / N), as torch.chunk, and so FSDP, splits them), because
    gather and scatter need equal pieces."""
    rows = -(-t.shape[0] // world)
    part = t.to_local()
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


# --- sharded checkpoints: each process writes and reads its own shards (weights/sharded.py)

def parameter_names(model: GPT, optimizers: list[torch.optim.Optimizer]) -> list[list[str]]:
    """Each optimizer's parameters by name, in its order, which map a state saved by name
    back to positions (the tied head is the token table's parameter, named once)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for group in opt.param_groups for p in group["params"]]
            for opt in optimizers]


def shard_tensors(model: GPT, optimizers: list[torch.optim.Optimizer],
                  ) -> dict[str, torch.Tensor]:
    """The tensors a sharded checkpoint holds, as this process holds them: the weights as
    model.NAME, each optimizer's state as optimizer.I.PARAM.KEY."""
    tensors = {f"model.{name}": value for name, value in model.state_dict().items()
               if not (model.config.tie_embeddings and name == "lm_head.weight")}  # saved once, as wte
    for i, (opt, names) in enumerate(zip(optimizers, parameter_names(model, optimizers),
                                         strict=True)):
        params = [p for group in opt.param_groups for p in group["params"]]
        for p, name in zip(params, names, strict=True):
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer.{i}.{name}.{key}"] = value
    return tensors


def write_sharded(run_dir: Path, state: TrainState, tensors: dict[str, torch.Tensor], model: GPT,
                  optimizers: list[torch.optim.Optimizer], dist: distributed.Dist,
                  is_best: bool) -> Path:
    """last.dcp from every process (its shards, `tensors`), and best.dcp as a second name."""
    rest = {k: v for k, v in state.to_dict().items() if k not in ("model", "optimizer")}
    rest["shards"] = {"optimizers": [
        {"params": opt_names, "param_groups": opt.state_dict()["param_groups"]}
        for opt, opt_names in zip(optimizers, parameter_names(model, optimizers), strict=True)]}
    folder = distributed.from_main(lambda: sharded.new_folder(run_dir, state.iter_num), dist)
    try:
        sharded.write_shards(tensors, rest, folder, dist.is_main)
    except BaseException:  # a full disk, say, and no half-written save is left behind
        if dist.is_main:
            sharded.tidy(run_dir)
        raise
    if dist.is_main:
        sharded.link(run_dir, "last", folder)
        if is_best:
            sharded.link(run_dir, "best", folder)
        sharded.tidy(run_dir)
    return run_dir / f"last{sharded.SUFFIX}"


def fill_from_shards(saved: TrainState, path: Path, model: GPT,
                     optimizers: list[torch.optim.Optimizer]) -> None:
    """Read a sharded checkpoint's weights and optimizer state into saved, laid out as this
    process holds them (its shards of each, or the whole where the model is not sharded),
    reading nothing else, so that it holds what last.pt would have given."""
    shapes = sharded.tensor_shapes(path)
    current = model.state_dict()
    params = dict(model.named_parameters())
    targets = {}
    for key, (shape, dtype) in shapes.items():
        kind, _, name = key.partition(".")
        if kind == "model":
            like = current.get(name)
        else:  # optimizer.I.PARAM.KEY: shaped as its parameter, or a count (AdamW's step)
            like = params.get(name.partition(".")[2].rpartition(".")[0])
        if like is not None and like.shape == shape:
            targets[key] = torch.empty_like(like, dtype=dtype)
        elif kind == "model":
            raise CheckpointError(f"cannot resume: {path} holds {name} of shape {tuple(shape)}, "
                                  f"not this model's; the run's settings differ from its own")
        else:
            targets[key] = torch.empty(shape, dtype=dtype)
    sharded.read_shards(targets, path, shapes)
    saved.model = {key.removeprefix("model."): value for key, value in targets.items()
                   if key.startswith("model.")}
    if model.config.tie_embeddings:  # one table, as in last.pt
        saved.model["lm_head.weight"] = saved.model["transformer.wte.weight"]
    names = parameter_names(model, optimizers)
    saved.optimizer = [
        {"state": {index: entry for index, name in enumerate(opt_names)
                   if (entry := {key.rpartition(".")[2]: value for key, value in targets.items()
                                 if key.startswith(f"optimizer.{i}.{name}.")})},
         "param_groups": opt.state_dict()["param_groups"]}
        for i, (opt, opt_names) in enumerate(zip(optimizers, names, strict=True))]


def forward_as_often_as_the_others(model: torch.nn.Module, batches: list, info: Dist,
                                   device: torch.device, autocast: Any) -> None:
    """A sharded model's forward is a collective, so every process must call it as often as
    the others. Where an evaluation's batches do not divide among the processes, those with
    one fewer run the forward once more on the last batch, whose loss is not counted."""
    for _ in range(-(-len(batches) // info.world_size) - len(batches[info.rank::info.world_size])):
        x, y = (t.to(device) for t in batches[-1])
        with autocast:
            model(x, y)
