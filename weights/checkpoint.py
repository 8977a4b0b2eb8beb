"""The checkpoint format: atomic writes, safe loading, and the model rebuilt from the file.

Usage:
    from weights.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint(state, "runs/quickstart/last.pt")     # a TrainState, or a dict of its keys
    ckpt = load_checkpoint("runs/quickstart/best.pt")     # checked; weights/loading.py builds
                                                          # the model (model_from_checkpoint)

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so it loads with
torch.load(weights_only=True), which runs no pickled code. It holds the model shape, the weights,
the optimizer state, the iteration, the training config and the tokenizer, so sampling
needs nothing else.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.tokenizer import tokenizer_problem
from machine.errors import UserError
from machine.files import atomic_write, fsync_dir, record_problem

FORMAT = "gptlab-checkpoint"
VERSION = 1
# what sampling, evaluating and exporting need, so every checkpoint holds these
REQUIRED = {"model_args": dict, "model": dict, "iter_num": int, "config": dict,
            "tokenizer": dict}
# what --resume needs beyond that (TrainState holds it all)
RESUME = {"optimizer": (list, dict), "scaler": dict, "best_val_loss": (int, float), "rng": dict}
RESUME_RNG = {"torch": torch.Tensor, "batches": torch.Tensor}
# a sharded checkpoint's state.pt (weights/sharded.py), whose tensors are in the shards and
# which names each optimizer's parameters in order
SHARDED = {**{k: v for k, v in REQUIRED.items() if k != "model"}, "shards": dict}
SHARDED_RESUME = {k: v for k, v in RESUME.items() if k != "optimizer"}


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
                   best_val_loss=ckpt["best_val_loss"],
                   val_loss=ckpt.get("val_loss", math.nan), config=ckpt["config"],
                   tokenizer=ckpt["tokenizer"], rng=ckpt["rng"])


class CheckpointError(UserError):
    """A checkpoint file that cannot be used; the message says which and why."""


def save_checkpoint(state: TrainState | dict[str, Any], path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, fsynced, then renamed over the
    old one, so a crash at any moment leaves either the old or the new checkpoint whole."""
    # a full disk or an interrupt leaves the old checkpoint and no half-written file
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


class UnreadableFile(Exception):
    """A file that a safe torch.load cannot read; the message says why, in a few words."""


def safe_load(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> Any:
    """torch.load(weights_only=True), which runs no pickled code. A damaged or foreign file
    fails in many ways inside torch; each becomes one UnreadableFile. mmap maps the file's
    tensors rather than reading them, so only what is used is read."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch's own message suggests weights_only=False, which is not the fix for a file
        # from elsewhere
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise UnreadableFile(f"it holds a {refused[1]}, which a safe load refuses" if refused
                             else "not a file that torch.save wrote") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:  # a zip archive cut short
        raise UnreadableFile(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except OSError as e:
        raise UnreadableFile(f"cannot read it: {e.strerror}") from None
    except Exception:  # other bytes fail in the unpickler in other ways (IndexError, ...)
        raise UnreadableFile("not a file that torch.save wrote") from None


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
    problem = record_problem(ckpt, SHARDED if sharded else REQUIRED)
    if problem:
        raise CheckpointError(f"{path} is damaged: {problem}; use another checkpoint")
    problem = tokenizer_problem(ckpt["tokenizer"])
    if problem:
        raise CheckpointError(f"{path} is damaged: the tokenizer's description: {problem}; "
                              f"use another checkpoint")
    # imported here because a plain training run, which reads no checkpoint, need not read it
    from weights.fields import resume_problem, shape_problem
    problem = shape_problem(ckpt["model_args"])
    if problem:  # every use of a checkpoint builds its model, or compares its shape
        raise CheckpointError(f"{path} is damaged: its model_args are not a model shape "
                              f"({problem}); use another checkpoint")
    # what a resumed run also needs (missing if the file is damaged or written by other code)
    problem = resume and (record_problem(ckpt, SHARDED_RESUME if sharded else RESUME)
                          or record_problem(ckpt["rng"], RESUME_RNG)
                          or resume_problem(ckpt, sharded))
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}; it can be sampled, not "
                              f"continued: start a new run without --resume")
    return ckpt


def unwrap_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the '_orig_mod.' prefix that a torch.compile'd module puts on every name."""
    prefix = "_orig_mod."
    return {k.removeprefix(prefix): v for k, v in state_dict.items()}
