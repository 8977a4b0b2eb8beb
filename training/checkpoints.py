"""A run's checkpoints: what one holds (weights/checkpoint.py's TrainState), writing it,
and putting a run back as it left off. There are two formats: last.pt, one file from rank
0, and, under FSDP, last.dcp, in which each process writes its own shards (training/fsdp.py,
imported only then). Either resumes on any number of processes, sharded or not.

Usage:
    from training.checkpoints import snapshot, save
    state = snapshot(model, optimizers, scaler, batches, iter_num, ...)   # a TrainState
    save(run, state, model, optimizers, dist, is_best)     # every process calls it

training/resume.py, imported only by a resumed run, reads a checkpoint back.

A run folder's checkpoint is last.dcp if it has one (only a run under FSDP writes it, and it
removes an older last.pt), else last.pt; best.* likewise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.loader import BatchStream
from model import GPT
from training import distributed
from training.runs import Run, TrainingError
from weights.checkpoint import (
    CheckpointError,
    TrainState,
    link_checkpoint,
    non_finite,
    save_checkpoint,
)

SHARDED = ".dcp"  # weights/sharded.py's suffix, named here so a plain run need not import it


def snapshot(model: GPT, optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler,
             batches: BatchStream, iter_num: int, dtype: torch.dtype, best_val_loss: float,
             val_loss: float, config: dict, tokenizer: dict, device: torch.device) -> TrainState:
    """What a checkpoint of the run holds now. The batch state is the stream's before it drew
    the batch for the next step, so a resumed run draws exactly the batches this run would
    have drawn next. A sharded model's weights and moments are not in it: each process saves
    its own shards of them (see save)."""
    rng = {"torch": torch.get_rng_state(), "batches": batches.state}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    plain = not distributed.is_sharded(model)
    return TrainState(
        model_args=vars(model.config).copy(),
        model=model.state_dict() if plain else {},
        optimizer=[opt.state_dict() for opt in optimizers] if plain else [],
        scaler=scaler.state_dict(),  # float16's loss scaler; {} where it is disabled
        iter_num=iter_num, dtype=str(dtype).removeprefix("torch."), best_val_loss=best_val_loss,
        val_loss=val_loss, config=config, tokenizer=tokenizer, rng=rng)


def save(run: Run, state: TrainState, model: GPT, optimizers: list[torch.optim.Optimizer],
         dist: distributed.Dist, is_best: bool) -> None:
    """Write last.pt from rank 0, or under FSDP last.dcp from every process, and best too
    (the same checkpoint under a second name) when is_best; then record it as the run's. Nothing
    is written of a state that holds NaN or inf, and every process hears of it, so that all
    of them stop together; a failed write (a full disk) leaves the previous checkpoint."""
    sharded = distributed.is_sharded(model)
    if sharded:
        from training.fsdp import first_of_any, local, shard_tensors, write_sharded
        tensors = shard_tensors(model, optimizers)
        broken = first_of_any(non_finite({k: local(v) for k, v in tensors.items()}), dist)
    else:
        broken = distributed.from_main(
            lambda: non_finite({"model": state.model, "optimizer": state.optimizer}), dist)
    if broken is not None:  # only this check sees weights that turned NaN between log points
        raise TrainingError(f"{broken} holds NaN or inf at iter {state.iter_num}, so no "
                            f"checkpoint was written and the last good one is kept: "
                            f"lower learning_rate or set grad_clip", everywhere=True)
    try:
        if sharded:
            checkpoint = write_sharded(run.path, state, tensors, model, optimizers, dist, is_best)
        else:
            checkpoint = write_plain(run.path, state, dist, is_best)
    except (OSError, CheckpointError) as e:  # a full disk, mid-write too
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:200]
        # a sharded save fails on every process alike (DCP gathers the failures)
        raise TrainingError(f"could not write a checkpoint in {run.path} ({reason}) at "
                            f"iter {state.iter_num}; {run.resume_hint()}",
                            everywhere=sharded) from None
    run.saved(checkpoint, state.iter_num)


def write_plain(run_dir: Path, state: TrainState, dist: distributed.Dist, is_best: bool) -> Path:
    """last.pt from rank 0, and best.pt as a second name for it."""
    if dist.is_main:
        save_checkpoint(state, run_dir / "last.pt")
        unlink_sharded(run_dir, "last")
        # best.pt, a hard link, keeps this file when the next save renames a new one over last.pt
        if is_best:
            link_checkpoint(run_dir / "last.pt", run_dir / "best.pt")
            unlink_sharded(run_dir, "best")
    return run_dir / "last.pt"


def unlink_sharded(run_dir: Path, name: str) -> None:
    """A plain save of NAME.pt makes an older sharded NAME.dcp stale, so delete it."""
    if (run_dir / f"{name}{SHARDED}").is_symlink():
        from weights import sharded
        sharded.unlink_sharded_twin(run_dir, name)
