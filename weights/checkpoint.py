"""The checkpoint format: what a checkpoint holds, atomic writes, and loading one back.

Usage:
    from weights.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint(state, "runs/quickstart/last.pt")     # a TrainState, or a dict of its keys
    ckpt = load_checkpoint("runs/quickstart/best.pt")     # checked; weights/loading.py builds
                                                          # the model (model_from_checkpoint)

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so it loads with
torch.load(weights_only=True), which runs no pickled code (weights/safe_load.py). It holds the
model shape, the weights, the optimizer state, the iteration, the training config and the
tokenizer, so sampling needs nothing else. What each field must hold is checked in
weights/fields.py, which, like safe_load, is imported only where a checkpoint is read.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from machine.errors import UserError
from machine.files import atomic_write, fsync_dir

FORMAT = "gptlab-checkpoint"
VERSION = 1


@dataclass
class TrainState:
    """Every key of last.pt and best.pt besides the format and version, which is all that a
    resumed run needs to go on exactly. train.py writes it (training/checkpoints.py), --resume
    reads it back (training/resume.py), and nothing else names these keys."""
    model_args: dict[str, Any]  # GPTConfig's fields: the model's shape and layout
    model: dict[str, torch.Tensor]  # the weights, by GPT-2's names
    optimizer: list[dict]  # each optimizer's state_dict (AdamW's, or with muon, AdamW's and Muon's)
    scaler: dict  # float16's loss scaler (empty otherwise)
    iter_num: int  # optimizer steps taken
    dtype: str | None  # what the run computes in ("auto" chose it once); None if absent
    best_val_loss: float
    val_loss: float  # at this step, or NaN if not measured here (a save on a signal)
    config: dict[str, Any]  # the TrainConfig, as training/config.py's to_dict writes it
    tokenizer: dict  # the dataset's tokenizer, as data/tokenizer.py describes one
    # the random streams: torch's, the batch stream's (its state before the pending
    # batch was drawn) and, on a GPU, CUDA's
    rng: dict[str, torch.Tensor]

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))  # shallow, so the tensors are not copied

    @classmethod
    def from_checkpoint(cls, ckpt: dict[str, Any]) -> TrainState:
        """The state in a checkpoint that load_checkpoint(resume=True) accepted, with a lone
        optimizer state_dict (not in a list) read as a list of one."""
        optimizer = ckpt["optimizer"]
        return cls(model_args=ckpt["model_args"], model=unwrap_state_dict(ckpt["model"]),
                   optimizer=optimizer if isinstance(optimizer, list) else [optimizer],
                   scaler=ckpt["scaler"], iter_num=ckpt["iter_num"], dtype=ckpt.get("dtype"),
                   best_val_loss=ckpt["best_val_loss"], val_loss=ckpt.get("val_loss", math.nan),
                   config=ckpt["config"], tokenizer=ckpt["tokenizer"], rng=ckpt["rng"])


class CheckpointError(UserError):
    """A checkpoint file that cannot be used; the message says which and why."""


def save_checkpoint(state: TrainState | dict[str, Any], path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, fsynced, then renamed over the
    old one, so a crash at any moment leaves either the old or the new checkpoint whole."""
    with atomic_write(path) as f:
        contents = state.to_dict() if isinstance(state, TrainState) else state
        torch.save({"format": FORMAT, "version": VERSION, **contents}, f)


def non_finite(state: Any, name: str = "") -> str | None:
    """The name of the first floating-point tensor in a nested state (dicts, lists) that
    holds a NaN or an inf, or None. A checkpoint of such a state is worth nothing, yet it
    would be resumed, sampled and trusted."""
    if isinstance(state, torch.Tensor):
        return name if state.is_floating_point() and not torch.isfinite(state).all() else None
    items = (state.items() if isinstance(state, dict)
             else enumerate(state) if isinstance(state, list | tuple) else ())
    for key, value in items:
        found = non_finite(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def link_checkpoint(src: str | Path, dst: str | Path) -> None:
    """Make dst the same checkpoint as src without writing it again: a hard link (a copy
    where the file system has none), put in place by an atomic rename like any save."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)


def sharded_hint(run_dir: Path) -> str:
    """What to run where a plain checkpoint is needed and a run saved sharded ones."""
    return (f"{run_dir} holds sharded checkpoints (last.dcp, written under FSDP); make plain "
            f"ones beside them with: python export.py {run_dir} --plain")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    resume: bool = False, mmap: bool = False) -> dict[str, Any]:
    """Load and check a checkpoint and, with resume, that it holds all a resumed run needs;
    raise CheckpointError if it is missing, truncated, damaged or foreign (mmap goes to safe_load)."""
    path = Path(path)
    if path.suffix == ".dcp" and path.is_dir():
        raise CheckpointError(sharded_hint(path.parent))
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    from weights.safe_load import UnreadableFile, safe_load  # only where a checkpoint is read
    try:
        ckpt = safe_load(path, map_location, mmap)
    except UnreadableFile as e:
        raise CheckpointError(f"checkpoint {path} is truncated or not a checkpoint ({e})") from None
    return check_contents(ckpt, path, resume)


def check_contents(ckpt: Any, path: Path, resume: bool, sharded: bool = False) -> dict[str, Any]:
    """Return ckpt if it is a checkpoint of this format with what sampling needs (and, with
    resume, what a resumed run needs); otherwise raise a CheckpointError naming the problem.
    A sharded checkpoint's state.pt holds the rest of a TrainState, without its tensors."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint written by this project's train.py")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {ckpt.get('version')}; "
                              f"this code reads version {VERSION}")
    from weights.fields import checkpoint_problem, resume_problem  # only where a checkpoint is read
    if problem := checkpoint_problem(ckpt, sharded):
        raise CheckpointError(f"{path} is damaged: {problem}; use another checkpoint")
    # what a resumed run also needs (missing if the file is damaged or written by other code)
    if problem := resume and resume_problem(ckpt, sharded):
        raise CheckpointError(f"cannot resume from {path}: {problem}; it can be sampled, not "
                              f"continued: start a new run without --resume")
    return ckpt


def unwrap_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the '_orig_mod.' prefix that a torch.compile'd module puts on every name."""
    return {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
