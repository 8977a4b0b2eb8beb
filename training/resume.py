"""Resuming a run: its checkpoint read back, checked against the new command, and put back
into the model, the optimizers and the random streams. train.py imports this only when
--resume is given.

Usage:
    from training.resume import read_saved, restore
    checkpoint, saved = read_saved(run.path, device, mmap=False)   # last.dcp or last.pt, a TrainState
    iter_num, best_val_loss = restore(saved, checkpoint, model, optimizers, scaler, batches,
                                      meta, cfg, device)   # ConfigError naming a changed key

A run folder's checkpoint is last.dcp if it has one (only a run under FSDP writes it), else
last.pt. Either resumes on any number of processes, sharded or not.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.batches import BatchStream
from model import GPT
from training import distributed
from training.config import ConfigError, TrainConfig
from training.runs import SHARDED
from weights.checkpoint import CheckpointError, TrainState, load_checkpoint
from weights.lazy import state_dict_mismatch


def last_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resumed run starts from: last.dcp, else last.pt, else None."""
    for path in (run_dir / f"last{SHARDED}", run_dir / "last.pt"):
        if path.exists():
            return path
    return None


def read_saved(run_dir: Path, device: torch.device, mmap: bool) -> tuple[Path, TrainState]:
    """The checkpoint a resumed run starts from, and the state it holds. A sharded checkpoint's
    weights and optimizer state are not read yet, because restore() reads each process's part of
    them. With mmap, a plain last.pt is mapped rather than read, so that each of several
    processes touches only the parts it keeps (its shards)."""
    path = last_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"nothing to resume in {run_dir}")
    if path.suffix == SHARDED:
        from weights import sharded
        state = sharded.read_state(path, resume=True)
        saved = TrainState.from_checkpoint({**state, "model": {}, "optimizer": []})
    else:
        ckpt = load_checkpoint(path, "cpu" if mmap else device, resume=True, mmap=mmap)
        saved = TrainState.from_checkpoint(ckpt)
    return path, saved


def restore(saved: TrainState, checkpoint: Path, model: GPT,
            optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler,
            batches: BatchStream, meta: dict, cfg: TrainConfig, device: torch.device) -> tuple[int, float]:
    """Put the run back as its checkpoint left it: weights, optimizer state, random
    streams and batches, once check_resumable has found nothing that the new command changes.
    Returns the iteration and the best val loss it had reached."""
    check_resumable(saved, model, meta, cfg, checkpoint)
    if checkpoint.suffix == SHARDED:  # each process reads its own shards
        from training.fsdp import fill_from_shards
        fill_from_shards(saved, checkpoint, model, optimizers)
    problem = state_dict_mismatch(model.state_dict(), saved.model, "model_args")
    if problem:
        raise CheckpointError(f"cannot resume: the weights in {checkpoint} do not match its "
                              f"model_args ({problem}); the file is damaged: start a new run "
                              f"without --resume")
    if distributed.is_sharded(model):  # each process takes its part of each whole tensor
        from training.fsdp import laid_out_like
        saved = laid_out_like(saved, model, optimizers)
    model.load_state_dict(saved.model)
    if len(saved.optimizer) != len(optimizers):
        raise CheckpointError(f"cannot resume: {checkpoint} holds the state of "
                              f"{len(saved.optimizer)} optimizers, and this run has "
                              f"{len(optimizers)}; the file is damaged: start a new run "
                              f"without --resume")
    for opt, state in zip(optimizers, saved.optimizer, strict=True):
        # the state (moments, momentum, step counts) is the run's; the settings (peak lr,
        # decay, betas, momentum) are the config's, which a resumed run may change
        settings = [{k: v for k, v in group.items() if k != "params"}
                    for group in opt.param_groups]
        opt.load_state_dict(state)
        for group, setting in zip(opt.param_groups, settings, strict=True):
            group.update(setting)
    # float16's loss scale, which a disabled scaler ignores; a run that turns to float16 from a
    # bf16 or fp32 checkpoint, which saved none, starts from a fresh scale
    if saved.scaler:
        scaler.load_state_dict(saved.scaler)
    # The checkpoint was read onto the device, but torch takes every generator's state as a CPU
    # tensor, the GPU's too.
    rng = {name: state.cpu() for name, state in saved.rng.items()}
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)
    batches.generator.set_state(rng["batches"])
    return saved.iter_num, saved.best_val_loss


# What a resumed run cannot change, and why; every other setting is the new config's (the
# lr schedule, the batch, the dtype, the intervals ...), the optimizers' settings included.
FIXED_ON_RESUME = {
    "seed": "a resumed run continues the random streams saved with it",
    "init_from": "a resumed run starts from its checkpoint",
}


def check_resumable(saved: TrainState, model: GPT, meta: dict, cfg: TrainConfig, path: Path) -> None:
    """Refuse to resume with other data, a different model shape, another optimizer, or a
    setting that a resumed run would ignore."""
    saved_optimizer = saved.config.get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(f"cannot resume: {path} was trained with optimizer = "
                          f"{saved_optimizer}, not {cfg.optimizer}; resume with --optimizer "
                          f"{saved_optimizer}, or start a new run")
    if saved.tokenizer != meta["tokenizer"]:
        raise ConfigError(f"cannot resume: {path} was trained with another tokenizer or "
                          f"vocabulary than the {meta['tokenizer']['kind']} data in data_dir; "
                          f"use the run's original data_dir")
    for key, value in saved.model_args.items():
        if getattr(model.config, key) != value:
            raise ConfigError(f"cannot resume: {key} is {getattr(model.config, key)} in the "
                              f"config but {value} in {path}; use the run's original settings")
    for key, why in FIXED_ON_RESUME.items():
        value = saved.config.get(key, getattr(cfg, key))
        if getattr(cfg, key) != value:
            raise ConfigError(f"cannot resume: {key} is {getattr(cfg, key)!r} in the config "
                              f"but {value!r} in {path}, and {why}; drop the option or start "
                              f"a new run")
    if saved.iter_num > cfg.max_iters:
        raise ConfigError(f"{path} is at iter {saved.iter_num}, past max_iters "
                          f"({cfg.max_iters}), so there is nothing to train; raise "
                          f"--max-iters to continue it")
