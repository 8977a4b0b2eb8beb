"""A checkpoint's fields besides its weights, checked beyond their types (which
machine.files.record_problem checks): the model's shape, which every use of a checkpoint
builds, and the values a resumed run puts back. It is imported only where a checkpoint is
read, which a plain training run never does.

Usage:
    from weights.fields import resume_problem, shape_problem
    shape_problem(ckpt["model_args"])        # "n_layer must be an integer, got '2'", or None
    resume_problem(ckpt, sharded=False)      # "its dtype is 'float8', not one of ...", or None
"""

from __future__ import annotations

import math
from typing import Any

import torch

from machine.device import DTYPES
from machine.files import record_problem
from model import GPTConfig
from weights.lazy import expected


def shape_problem(model_args: dict[str, Any]) -> str | None:
    """Why `model_args` are not a model's shape (GPTConfig refuses them, or a tensor of
    that shape could not exist); None if they are."""
    try:
        expected(GPTConfig(**model_args))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def resume_problem(ckpt: dict[str, Any], sharded: bool) -> str | None:
    """In a checkpoint whose fields have the right types, name a field whose value no run
    writes, which a resumed run could not put back; None if there is none."""
    dtype, val_loss = ckpt.get("dtype"), ckpt.get("val_loss", math.nan)
    if dtype is not None and dtype not in DTYPES:  # a file may have no dtype
        return f"its dtype is {dtype!r:.40}, not one of {', '.join(DTYPES)}"
    if ckpt["iter_num"] < 0:
        return f"its iter_num is {ckpt['iter_num']}, below 0"
    if math.isnan(ckpt["best_val_loss"]):  # inf means no evaluation yet
        return "its best_val_loss is NaN"
    if not isinstance(val_loss, int | float) or isinstance(val_loss, bool):
        return f"its val_loss is {val_loss!r:.40}, not a number"
    for stream in ("torch", "batches"):
        problem = generator_problem(ckpt["rng"][stream], f"rng.{stream}")
        if problem:
            return problem
    cuda = ckpt["rng"].get("cuda")  # a GPU's stream, put back only on a GPU
    if cuda is not None and not isinstance(cuda, torch.Tensor):
        return f"its rng.cuda is {cuda!r:.40}, not a random generator's state"
    return None if sharded else optimizer_problem(ckpt["optimizer"])


def generator_problem(state: torch.Tensor, name: str) -> str | None:
    """Why `state` cannot be a CPU random generator's state (the bytes of
    torch.Generator.get_state), naming it; None if it can."""
    like = torch.Generator().get_state()
    if state.dtype != like.dtype or state.shape != like.shape:
        return (f"its {name} is a {str(state.dtype).removeprefix('torch.')} tensor of shape "
                f"{tuple(state.shape)}, not a random generator's state")
    return None


def optimizer_problem(optimizer: list | dict) -> str | None:
    """Why `optimizer` cannot be the optimizers' state_dicts (a list, or one alone), naming
    the first bad one; None if each has its state and groups of parameters."""
    for n, state in enumerate(optimizer if isinstance(optimizer, list) else [optimizer]):
        problem = record_problem(state, {"state": dict, "param_groups": list})
        if problem:
            return f"its optimizer state {n} is damaged: {problem}"
        groups = state["param_groups"]
        if not groups or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                 for g in groups):
            return f"its optimizer state {n} is damaged: it has no groups of parameters"
    return None
