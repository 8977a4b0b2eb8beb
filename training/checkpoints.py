"""A training run's checkpoints: what one holds (weights/checkpoint.py's TrainState) and
writing it, as last.pt from rank 0 or, under FSDP, as last.dcp, in which each process writes
its own shards (training/fsdp.py, imported only then). A run folder's checkpoint is last.dcp
if it has one, else last.pt, and best.* likewise; either resumes on any number of processes
(training/resume.py, imported only by a resumed run).

Usage:
    from training.checkpoints import Checkpoints
    checkpoints = Checkpoints(run, model, optimizers, scaler, batches, cfg=cfg, meta=meta, ...)
    iter_num, best_val_loss = checkpoints.restore(saved)   # a resumed run's TrainState put back
    checkpoints.save(iter_num, best_val_loss, val_loss, is_best)   # every process calls it
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.batches import BatchStream
from model import GPT
from training import distributed
from training.config import TrainConfig
from training.runs import SHARDED, Run, TrainingError
from weights.checkpoint import CheckpointError, TrainState, link_checkpoint, non_finite, save_checkpoint


class Checkpoints:
    """A training run's checkpoints: what goes into one, from the parts given here, writing it,
    and putting a saved one back into those parts."""

    def __init__(self, run: Run, model: GPT, optimizers: list[torch.optim.Optimizer],
                 scaler: torch.amp.GradScaler, batches: BatchStream, *, cfg: TrainConfig, meta: dict,
                 dtype: torch.dtype, device: torch.device, dist: distributed.Dist) -> None:
        self.run, self.model, self.optimizers, self.scaler = run, model, optimizers, scaler
        self.batches, self.dtype, self.cfg, self.meta = batches, dtype, cfg, meta  # meta: the dataset's
        self.device, self.dist = device, dist

    def restore(self, saved: TrainState) -> tuple[int, float]:
        """Put a resumed run's state back into the parts: its iteration and best val loss."""
        from training.resume import restore
        return restore(saved, self.run.checkpoint, self.model, self.optimizers, self.scaler,
                       self.batches, self.meta, self.cfg, self.device)

    def state(self, iter_num: int, best_val_loss: float, val_loss: float) -> TrainState:
        """What a checkpoint of the run holds now, with the batch stream's state from before it
        drew the next step's batch, so that a resumed run draws that batch again. Under FSDP
        the weights and moments are left out, because each process saves its own shards."""
        rng = {"torch": torch.get_rng_state(), "batches": self.batches.state}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        plain = not distributed.is_sharded(self.model)
        return TrainState(
            model_args=vars(self.model.config).copy(),
            model=self.model.state_dict() if plain else {},
            optimizer=[opt.state_dict() for opt in self.optimizers] if plain else [],
            scaler=self.scaler.state_dict(),  # float16's loss scale; {} when disabled
            iter_num=iter_num, dtype=str(self.dtype).removeprefix("torch."),
            best_val_loss=best_val_loss, val_loss=val_loss, config=self.cfg.to_dict(),
            tokenizer=self.meta["tokenizer"], rng=rng)

    def save(self, iter_num: int, best_val_loss: float, val_loss: float, is_best: bool) -> None:
        """Write last, and best too (a second name for it) when is_best; val_loss is NaN for a
        save between evaluations. Nothing is written of a state that holds NaN or inf, and every
        process hears of it, so that all stop together; a failed write leaves the previous one."""
        state, run, dist = self.state(iter_num, best_val_loss, val_loss), self.run, self.dist
        sharded = distributed.is_sharded(self.model)
        if sharded:
            from training.fsdp import first_of_any, local, shard_tensors, write_sharded
            tensors = shard_tensors(self.model, self.optimizers)
            broken = first_of_any(non_finite({k: local(v) for k, v in tensors.items()}), dist)
        else:
            broken = distributed.from_main(
                lambda: non_finite({"model": state.model, "optimizer": state.optimizer}), dist)
        if broken is not None:  # only this check sees weights that turned NaN between log points
            raise TrainingError.diverged(f"{broken} holds NaN or inf at iter {iter_num}, so no "
                                         f"checkpoint was written", everywhere=True)
        try:
            if sharded:
                checkpoint = write_sharded(run.path, state, tensors, self.model, self.optimizers,
                                           dist, is_best)
            else:
                checkpoint = write_plain(run.path, state, dist, is_best)
        except (OSError, CheckpointError) as e:  # a full disk, mid-write too
            reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:200]
            # a sharded save fails on every process alike (DCP gathers the failures)
            raise TrainingError(f"could not write a checkpoint in {run.path} ({reason}) at "
                                f"iter {iter_num}; {run.resume_hint()}",
                                everywhere=sharded) from None
        run.record_checkpoint(checkpoint, iter_num)


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
