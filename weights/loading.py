"""A model to run, and its tokenizer: from a run folder, a checkpoint or a Hugging Face folder
(GPT-2's or NanoChat's), in the weight dtype asked for. Shared by sample.py and evaluate.py.

Usage:
    from weights.loading import load_model
    model, tokenizer, source = load_model(run="quickstart", device="cpu", dtype="int8")
    model, tokenizer, source = load_model(init_from="path/to/gpt2")  # config.json + weights
    model, tokenizer, source = load_base("runs/quickstart", block_size=64)  # what to fine-tune
    model = grow_vocabulary(model, 70)   # room for tokens the base never had (chat's)
    config, state, tokenizer, source = base_weights("runs/quickstart")  # not read yet
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from data.bpe_tokenizers import GPT2Tokenizer
from data.hf_tokenizer import HFTokenizer
from data.tokenizer import Tokenizer, load_tokenizer
from machine.errors import UserError
from model import GPT, GPTConfig
from weights.checkpoint import (
    CheckpointError,
    load_checkpoint,
    sharded_hint,
    unwrap_state_dict,
)
from weights.hf import FolderError, model_type
from weights.hub import local_folder
from weights.lazy import Lazy, build, cropped, expected, grown, mapped, state_dict_mismatch
from weights.quantize import cast_weights, check_weight_dtype


class LoadError(UserError):
    """No model where the user pointed; the message says what is there and what to do."""


DIVERGED = "its run diverged; use an earlier checkpoint"  # the fix for a checkpoint's NaN


def run_checkpoint(folder: Path) -> Path | None:
    """A run folder's best.pt; else its last.pt (all that a run stopped before its first
    evaluation has), with a note on stderr; else None. A sharded best or last checkpoint
    (FSDP's best.dcp or last.dcp) raises a CheckpointError saying how to make a plain one."""
    for name in ("best", "last"):
        if (folder / f"{name}.pt").is_file():
            if name == "last":
                print(f"note: {folder} has no best.pt yet (it stopped before its first "
                      f"evaluation); using its last.pt", file=sys.stderr)
            return folder / f"{name}.pt"
        if (folder / f"{name}.dcp").exists():
            raise CheckpointError(sharded_hint(folder))
    return None


def resolve_checkpoint(run: str | None, checkpoint: str | None, out_dir: str = "runs",
                       prefer: str | None = None) -> Path:
    """--checkpoint as given; else the checkpoint of --run; else that of the newest run (see
    choose_checkpoint)."""
    return choose_checkpoint(run, checkpoint, out_dir, prefer)[0]


def choose_checkpoint(run: str | None, checkpoint: str | None, out_dir: str = "runs",
                      prefer: str | None = None) -> tuple[Path, str]:
    """resolve_checkpoint's checkpoint, and why it was chosen if nobody named it: the newest
    run's (the run whose checkpoint was written last) or, with prefer "base" or "chat", the
    newest run of that kind if there is one. A base model continues text; a chat model
    (trained on conversations) answers turns."""
    if checkpoint:
        return Path(checkpoint), ""
    if run:
        folder = Path(run)
        if not folder.exists() and len(folder.parts) == 1:
            folder = Path(out_dir) / run  # a bare run name, e.g. --run quickstart
        path = run_checkpoint(folder)
        if path is None:  # most likely a mistyped run name, so list the runs beside it
            runs = sorted({str(p.parent) for name in ("best.pt", "last.pt")
                           for p in folder.parent.glob(f"*/{name}")})
            beside = str(folder.parent).rstrip("/") + "/"  # "/" for a folder at the root
            raise LoadError(f"no checkpoint (best.pt or last.pt) in {folder}; runs in {beside} "
                            f"that have one: {', '.join(runs) or 'none'}")
        return path, ""
    written = [p for name in ("best.pt", "last.pt", "best.dcp", "last.dcp")
               for p in Path(out_dir).glob(f"*/{name}")]
    if not written:
        raise LoadError(f"no checkpoint found under {out_dir}/; train first "
                        f"(python train.py --config config/quickstart.toml) or pass --checkpoint")
    by_age = sorted({p.parent for p in written}, key=lambda folder: -max(
        p.stat().st_mtime for p in written if p.parent == folder))
    newest = by_age[0]
    if prefer is None or is_chat_run(newest) == (prefer == "chat"):
        return run_checkpoint(newest), "the newest run"
    kind = "chat" if prefer == "chat" else "base"
    fitting = next((folder for folder in by_age if is_chat_run(folder) == (prefer == "chat")),
                   None)
    if fitting is None:
        return run_checkpoint(newest), f"the newest run; there is no {kind} model under {out_dir}/"
    other = "a chat model" if kind == "base" else "a base model"
    return run_checkpoint(fitting), (f"the newest {kind} model; the newest run, {newest}, is "
                                     f"{other}: name it with --run to use it")


def is_chat_run(folder: Path) -> bool:
    """Whether a run folder's model was trained on conversations: its tokenizer has the
    chat tokens (data/chat.py). Its checkpoint is mapped, not read, so only a small part is."""
    path = next((folder / f"{name}.pt" for name in ("best", "last")
                 if (folder / f"{name}.pt").is_file()), None)
    if path is None:
        return False
    try:
        specials = load_checkpoint(path, mmap=True)["tokenizer"].get("specials", [])
    except CheckpointError:
        return False
    return "<|assistant_start|>" in specials


def load_folder(folder: str | Path, block_size: int | None = None,
                dropout: float = 0.0) -> tuple[GPT, Tokenizer]:
    """The model and tokenizer of a Hugging Face folder, GPT-2's or NanoChat's, read with its
    own tokenizer.json. block_size below the folder's crops it."""
    config, state, tokenizer = folder_weights(folder, block_size, dropout)
    return build(config, state).eval(), tokenizer


def folder_weights(folder: str | Path, block_size: int | None = None, dropout: float = 0.0,
                   ) -> tuple[GPTConfig, dict[str, Lazy], Tokenizer]:
    """load_folder's model as its shape and weights not read yet (weights/lazy.py). A Hub
    id is downloaded first (weights/hub.py)."""
    from weights.gpt2 import hf_gpt2_weights
    from weights.nanochat import hf_nanochat_weights
    folder = local_folder(folder)
    kind = model_type(folder)
    if kind == "gpt2":
        (config, state), tokenizer = hf_gpt2_weights(folder, dropout), gpt2_folder_tokenizer(folder)
    elif kind == "nanochat":
        (config, state), tokenizer = hf_nanochat_weights(folder, dropout), folder_tokenizer(folder)
    else:
        raise FolderError(f"{folder} holds a {kind!r} model; --init-from reads GPT-2 and "
                          f"NanoChat folders")
    if block_size is not None and block_size > config.block_size:
        raise FolderError(f"block_size {block_size} exceeds {folder}'s context of "
                          f"{config.block_size} tokens")
    if config.vocab_size < tokenizer.vocab_size:
        whose = ("its tokenizer.json" if (Path(folder) / "tokenizer.json").is_file() else
                 "GPT-2's tokenizer, which reads a folder without tokenizer.json")
        raise LoadError(f"{folder} has a vocabulary of {config.vocab_size:,} tokens, fewer "
                        f"than the {tokenizer.vocab_size:,} of {whose}")
    state = finite(state, str(folder), "the weights are damaged, or the model they were "
                                       "saved from had diverged; use another copy")
    return (*cropped(config, state, block_size), tokenizer)


# a few of GPT-2's tokens and their ids, which mark a tokenizer.json as GPT-2's own
GPT2_FINGERPRINT = {"!": 0, "\u0120the": 262, "<|endoftext|>": 50256}


def gpt2_folder_tokenizer(folder: str | Path) -> Tokenizer:
    """A GPT-2 folder's tokenizer: its tokenizer.json, unless that is GPT-2's own BPE (or
    absent), which this project encodes itself, so that data prepared with --tokenizer gpt2
    fits the folder's model."""
    if not (Path(folder) / "tokenizer.json").is_file():
        return GPT2Tokenizer()
    tokenizer = folder_tokenizer(folder)
    ids = {token: tokenizer.backend.token_to_id(token) for token in GPT2_FINGERPRINT}
    if tokenizer.vocab_size == 50257 and ids == GPT2_FINGERPRINT:
        return GPT2Tokenizer()
    return tokenizer


def folder_tokenizer(folder: str | Path) -> HFTokenizer:
    """The tokenizer.json of a folder; FolderError if it is missing or not one this reads."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FolderError(f"{folder} has no tokenizer.json; a NanoChat folder needs one")
    try:
        return HFTokenizer(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise FolderError(f"{path}: {e}") from None


def load_model(run: str | None = None, checkpoint: str | None = None,
               init_from: str | None = None, device: str = "cpu",
               dtype: str = "float32", prefer: str | None = None,
               say: Callable[[str], None] | None = None) -> tuple[GPT, Tokenizer, str]:
    """The model on `device` with weights in `dtype` (see quantize.WEIGHT_DTYPES), in eval
    mode, its tokenizer, and where it came from. init_from wins over run and checkpoint;
    without any of them, the newest run is loaded (see choose_checkpoint for `prefer`). `say`
    gets one line saying what was loaded and, if nobody named it, why."""
    check_weight_dtype(dtype)  # before a checkpoint is read
    why = ""
    if init_from:
        (model, tokenizer), source = load_folder(init_from), init_from
    else:
        path, why = choose_checkpoint(run, checkpoint, prefer=prefer)
        ckpt = load_checkpoint(path, map_location="cpu")
        model, source = model_from_checkpoint(ckpt), str(path)
        try:
            tokenizer = load_tokenizer(ckpt["tokenizer"])
        except ValueError as e:
            raise LoadError(f"{path}: {e}; the checkpoint is damaged") from None
    if say is not None:
        say(f"loaded {source}" + (f" ({why})" if why else ""))
    return cast_weights(model.to(device).eval(), dtype), tokenizer, source


def load_base(path: str | Path, block_size: int | None = None,
              dropout: float = 0.0) -> tuple[GPT, Tokenizer, str]:
    """The model to fine-tune (train.py's init_from), its tokenizer, and where it came
    from: a Hugging Face folder, a checkpoint, or a run folder (its best.pt). block_size
    below the model's crops it; dropout is the fine-tuning's."""
    config, state, tokenizer, source = base_weights(path, block_size, dropout)
    return build(config, state), tokenizer, source


def base_weights(path: str | Path, block_size: int | None = None, dropout: float = 0.0,
                 ) -> tuple[GPTConfig, dict[str, Lazy], Tokenizer, str]:
    """load_base's model as its shape and weights not read yet (weights/lazy.py): a
    checkpoint is mapped, not loaded, so that each of several processes reads only its
    shards of it."""
    folder = local_folder(path)
    if (folder / "config.json").is_file():
        return (*folder_weights(folder, block_size, dropout), str(folder))
    checkpoint = folder if folder.is_file() else run_checkpoint(folder) if folder.is_dir() else None
    if checkpoint is None:
        raise LoadError(f"{path} is neither a Hugging Face folder (config.json), a checkpoint "
                        f"(.pt) nor a run folder (best.pt or last.pt); give one of them")
    ckpt = load_checkpoint(checkpoint, map_location="cpu", mmap=True)
    config = GPTConfig(**{**ckpt["model_args"], "dropout": dropout})
    state = mapped(unwrap_state_dict(ckpt["model"]))
    problem = state_dict_mismatch(expected(config), state, "model_args")
    if problem:
        raise CheckpointError(f"{checkpoint}'s weights do not match its model_args: {problem}; "
                              f"the file is damaged, use another checkpoint")
    state = finite(state, str(checkpoint), DIVERGED)
    try:
        tokenizer = load_tokenizer(ckpt["tokenizer"])
    except ValueError as e:
        raise LoadError(f"{checkpoint}: {e}; the checkpoint is damaged") from None
    return (*cropped(config, state, block_size), tokenizer, str(checkpoint))


def grow_vocabulary(model: GPT, vocab_size: int) -> GPT:
    """The model with rows added to its token table (and to an untied head and the bigram
    table) for the ids from its vocabulary size up to vocab_size, each the mean of the old
    rows (weights.lazy.grown)."""
    grown_model = build(*grown(model.config, mapped(model.state_dict()), vocab_size))
    return grown_model.train(model.training)


def model_from_checkpoint(ckpt: dict[str, Any]) -> GPT:
    """A GPT with the shape and weights of a checkpoint that load_checkpoint accepted, on the
    CPU, in eval mode."""
    config = GPTConfig(**ckpt["model_args"])
    state = unwrap_state_dict(ckpt["model"])
    problem = state_dict_mismatch(expected(config), state, "model_args")
    if problem:
        raise CheckpointError(f"the checkpoint's weights do not match its model_args: {problem}; "
                              f"the file is damaged, use another checkpoint")
    # train.py refuses to save a diverged run, but a file written by other code may hold one
    return build(config, finite(mapped(state), "the checkpoint", DIVERGED)).eval()


def finite(state: dict[str, Lazy], source: str, fix: str) -> dict[str, Lazy]:
    """The weights, each checked as it is read, wherever a model is loaded. A tensor holding
    NaN or inf is refused in one line naming it and `fix`, because such a model samples from
    NaN probabilities and scores every choice alike without an error. One that is not
    floating point (a damaged file) is refused too, rather than cast."""
    def check(tensor: torch.Tensor, name: str) -> torch.Tensor:
        if not tensor.is_floating_point():
            raise LoadError(f"{source}'s {name} holds {str(tensor.dtype).removeprefix('torch.')} "
                            f"values, where weights are floating point; the file is damaged, "
                            f"use another copy")
        # float8 has no isfinite, so its values are checked in float32
        if not torch.isfinite(tensor if tensor.element_size() > 1 else tensor.float()).all():
            raise LoadError(f"{source}'s {name} holds NaN or inf: {fix}")
        return tensor
    return {name: lazy.then(partial(check, name=name)) for name, lazy in state.items()}
