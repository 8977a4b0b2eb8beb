"""The checks on a checkpoint's fields other than its weights. They check that every required
key is there with the right type (with machine.files.record_problem), then the tokenizer's
description and the model's shape, which every use of a checkpoint builds, and what a
resumed run puts back. This module is imported only where a checkpoint is read, which a
plain training run never does.

Usage:
    from weights.fields import checkpoint_problem, resume_problem, shape_problem
    checkpoint_problem(ckpt, sharded=False)   # "it lacks model_args", or None
    shape_problem(ckpt["model_args"])        # "n_layer must be an integer, got '2'", or None
    resume_problem(ckpt, sharded=False)      # "its dtype is 'float8', not one of ...", or None
"""

from __future__ import annotations

import math
from typing import Any

import torch

from data.tokenizer import tokenizer_problem
from machine.device import DTYPES
from machine.files import record_problem
from model import GPTConfig
from weights.lazy import expected

# what sampling, evaluating and exporting need, so every checkpoint holds these
REQUIRED = {"model_args": dict, "model": dict, "iter_num": int, "config": dict,
            "tokenizer": dict}
# what --resume needs beyond that (weights.checkpoint.TrainState holds it all)
RESUME = {"optimizer": (list, dict), "scaler": dict, "best_val_loss": (int, float), "rng": dict}
RESUME_RNG = {"torch": torch.Tensor, "batches": torch.Tensor}
# a sharded checkpoint's state.pt (weights/sharded.py), whose tensors are in the shards and
# which names each optimizer's parameters in order
SHARDED = {**{k: v for k, v in REQUIRED.items() if k != "model"}, "shards": dict}
SHARDED_RESUME = {k: v for k, v in RESUME.items() if k != "optimizer"}


def checkpoint_problem(ckpt: dict[str, Any], sharded: bool) -> str | None:
    """What makes a checkpoint of this format unusable for anything, in words that name the
    field: a key it lacks or of the wrong type, its tokenizer's description, or model_args
    that are no model's shape; None if nothing does."""
    problem = record_problem(ckpt, SHARDED if sharded else REQUIRED)
    if problem:
        return problem
    problem = tokenizer_problem(ckpt["tokenizer"])
    if problem:
        return f"the tokenizer's description: {problem}"
    problem = shape_problem(ckpt["model_args"])
    if problem:  # every use of a checkpoint builds its model, or compares its shape
        return f"its model_args are not a model shape ({problem})"
    return None


def shape_problem(model_args: dict[str, Any]) -> str | None:
    """Why `model_args` are not a model's shape (GPTConfig refuses them, or a tensor of
    that shape could not exist); None if they are."""
    try:
        expected(GPTConfig(**model_args))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def resume_problem(ckpt: dict[str, Any], sharded: bool) -> str | None:
    """In a checkpoint that checkpoint_problem() passed, name a field that a resumed run needs
    and lacks, or whose value no run writes, which it could not put back; None if there is none."""
    problem = (record_problem(ckpt, SHARDED_RESUME if sharded else RESUME)
               or record_problem(ckpt["rng"], RESUME_RNG))
    if problem:
        return problem
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
