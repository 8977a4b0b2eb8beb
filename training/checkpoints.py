"""A run's checkpoints, in the two formats: last.pt (one file, from rank 0) and, under
FSDP, last.dcp (each process writes its shards: weights/sharded.py). Either resumes on any
number of processes, sharded or not.

Usage:
    from training.checkpoints import write, read_saved, fill_from_shards
    write(run_dir, state, tensors, model, optimizers, dist, is_best)  # every process calls
    saved, shards = read_saved(run_dir, device, mmap=fsdp)       # a TrainState, and where
    fill_from_shards(saved, shards, model, optimizers)           # its tensors are, if sharded

A run folder's checkpoint is last.dcp if it has one (only a run under FSDP writes it, and it
removes an older last.pt), else last.pt; best.* likewise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model import GPT
from training import distributed
from weights import sharded
from weights.checkpoint import (
    CheckpointError,
    TrainState,
    link_checkpoint,
    load_checkpoint,
    non_finite,
    save_checkpoint,
)


def last_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resumed run starts from: last.dcp, else last.pt, else None."""
    for path in (run_dir / f"last{sharded.SUFFIX}", run_dir / "last.pt"):
        if path.exists():
            return path
    return None


def parameter_names(model: GPT, optimizers: list[torch.optim.Optimizer]) -> list[list[str]]:
    """Each optimizer's parameters by name, in its order: what a state saved by name maps
    back to positions with (the tied head is the token table's parameter, named once)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for group in opt.param_groups for p in group["params"]]
            for opt in optimizers]


def shard_tensors(model: GPT, optimizers: list[torch.optim.Optimizer],
                  ) -> dict[str, torch.Tensor]:
    """The tensors a sharded checkpoint holds, as this process holds them: the weights as
    model.NAME, each optimizer's state as optimizer.I.PARAM.KEY."""
    tensors = {f"model.{name}": value for name, value in model.state_dict().items()
               if not (model.config.tie_embeddings and name == "lm_head.weight")}  # wte's
    for i, (opt, names) in enumerate(zip(optimizers, parameter_names(model, optimizers),
                                         strict=True)):
        params = [p for group in opt.param_groups for p in group["params"]]
        for p, name in zip(params, names, strict=True):
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer.{i}.{name}.{key}"] = value
    return tensors


def broken_tensor(state: TrainState, tensors: dict[str, torch.Tensor] | None,
                  dist: distributed.Dist) -> str | None:
    """The name of a tensor about to be saved that holds NaN or inf, on every process, or
    None. Sharded: each process checks its own shards and every process hears of any."""
    if tensors is None:
        return distributed.from_main(
            lambda: non_finite({"model": state.model, "optimizer": state.optimizer}), dist)
    return distributed.first_of_any(non_finite({k: distributed.local(v)
                                                for k, v in tensors.items()}), dist)


def write(run_dir: Path, state: TrainState, tensors: dict[str, torch.Tensor] | None,
          model: GPT, optimizers: list[torch.optim.Optimizer], dist: distributed.Dist,
          is_best: bool) -> Path:
    """Save the run: last.pt from rank 0 (tensors None), or last.dcp from every process
    (tensors: this process's shards); best too, as the same checkpoint, when is_best.
    Returns last's path."""
    if tensors is None:
        if dist.is_main:
            save_checkpoint(state, run_dir / "last.pt")
            sharded.unlink_sharded_twin(run_dir, "last")
            if is_best:  # the same file under a second name: no second write
                link_checkpoint(run_dir / "last.pt", run_dir / "best.pt")
                sharded.unlink_sharded_twin(run_dir, "best")
        return run_dir / "last.pt"
    rest = {k: v for k, v in state.to_dict().items() if k not in ("model", "optimizer")}
    rest["shards"] = {"optimizers": [
        {"params": opt_names, "param_groups": opt.state_dict()["param_groups"]}
        for opt, opt_names in zip(optimizers, parameter_names(model, optimizers), strict=True)]}
    folder = distributed.from_main(lambda: sharded.new_folder(run_dir, state.iter_num), dist)
    try:
        sharded.write_shards(tensors, rest, folder, dist.is_main)
    except BaseException:  # a full disk: no half-written save is left behind
        if dist.is_main:
            sharded.tidy(run_dir)
        raise
    if dist.is_main:
        sharded.link(run_dir, "last", folder)
        if is_best:
            sharded.link(run_dir, "best", folder)
        sharded.tidy(run_dir)
    return run_dir / f"last{sharded.SUFFIX}"


def read_saved(run_dir: Path, device: torch.device, mmap: bool,
               ) -> tuple[TrainState, Path | None]:
    """The state a resumed run starts from, and the sharded checkpoint its weights and
    optimizer state are still to be read from (fill_from_shards), or None when they came
    with it. mmap: map a plain last.pt rather than read it, so that each of several
    processes touches only the parts it keeps (its shards)."""
    path = last_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"nothing to resume in {run_dir}")
    if path.suffix == sharded.SUFFIX:
        state = sharded.read_state(path, resume=True)
        return TrainState.from_checkpoint({**state, "model": {}, "optimizer": []}), path
    ckpt = load_checkpoint(path, "cpu" if mmap else device, resume=True, mmap=mmap)
    return TrainState.from_checkpoint(ckpt), None


def fill_from_shards(saved: TrainState, path: Path, model: GPT,
                     optimizers: list[torch.optim.Optimizer]) -> None:
    """Read a sharded checkpoint's weights and optimizer state into saved, laid out as this
    process holds them (its shards of each, or the whole where the model is not sharded),
    reading nothing else: the state last.pt would have given, for restore()."""
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
    if model.config.tie_embeddings:  # one table, as unsharded
        saved.model["lm_head.weight"] = saved.model["transformer.wte.weight"]
    names = parameter_names(model, optimizers)
    saved.optimizer = [
        {"state": {index: entry for index, name in enumerate(opt_names)
                   if (entry := {key.rpartition(".")[2]: value for key, value in targets.items()
                                 if key.startswith(f"optimizer.{i}.{name}.")})},
         "param_groups": opt.state_dict()["param_groups"]}
        for i, (opt, opt_names) in enumerate(zip(optimizers, names, strict=True))]

