"""Hugging Face model folders: reading config.json and the weights, and writing a folder
whole. gpt2.py and nanochat.py handle the formats themselves (GPT-2's and NanoChat's).

Usage:
    from weights.hf import model_type, read_config, read_weights, write_folder
    model_type("models/nanochat")                       # "gpt2", "nanochat", ...
    config, weights = read_config(folder), read_weights(folder)   # name -> Lazy tensor
    write_folder("out/hf", {"config.json": b"...", "model.safetensors": b"..."}, force=False)

Nothing is downloaded: every function takes a folder you have.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from machine.errors import UserError
from machine.files import fsync_dir, write_bytes_atomic
from weights.lazy import Lazy, mapped
from weights.safe_load import UnreadableFile, safe_load

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class FolderError(UserError):
    """A Hugging Face folder that cannot be used; the message says what is wrong."""


class ExportError(UserError):
    """A folder that an export must not or cannot write into; the message says why."""


def read_config(folder: str | Path) -> dict:
    """config.json of a model folder, as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FolderError(f"{folder} has no config.json; point at a Hugging Face model folder "
                          f"(GPT-2 or NanoChat)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8 or not JSON, or too long or too deep
        raise FolderError(f"{path} is not valid JSON ({str(e) or type(e).__name__:.120}); "
                          f"point at a Hugging Face model folder") from None
    if not isinstance(config, dict):
        raise FolderError(f"{path} holds a {type(config).__name__}, not a model's settings")
    return config


def model_type(folder: str | Path) -> str:
    """The folder's architecture as transformers names it: config.json's model_type (folders
    written before transformers recorded it are GPT-2's)."""
    return str(read_config(folder).get("model_type", "gpt2"))


def read_weights(folder: str | Path) -> dict[str, Lazy]:
    """The named tensors of model.safetensors, else of pytorch_model.bin (loaded safely), as
    Lazy tensors, each read when asked for, one at a time (the .bin file is mapped)."""
    for name in WEIGHT_FILES:
        path = Path(folder) / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    return safetensors_weights(path)
                # map it if it is a zip file, which is torch.save's default format
                weights = safe_load(path, mmap=zipfile.is_zipfile(path))
            except (SafetensorError, OSError, UnreadableFile) as e:
                reason = (str(e).splitlines() or [type(e).__name__])[0]
                raise FolderError(f"{path} is truncated or not a weights file ({reason}); "
                                  f"download or export the folder again") from None
            if not (isinstance(weights, dict)
                    and all(isinstance(v, torch.Tensor) for v in weights.values())):
                raise FolderError(f"{path} does not hold named weight tensors (a saved "
                                  f"state_dict); download or export the folder again")
            return mapped(weights)
    raise FolderError(f"{folder} has neither {' nor '.join(WEIGHT_FILES)}")


def safetensors_weights(path: Path) -> dict[str, Lazy]:
    """A safetensors file's tensors, each read from the mapped file when asked for. The
    header (names, shapes, where each lies) is checked against the file's size on opening."""
    f = safe_open(path, framework="pt")
    return {name: Lazy(torch.Size(f.get_slice(name).get_shape()),
                       lambda name=name: f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118


def write_folder(folder: str | Path, files: dict[str, bytes], force: bool = False) -> Path:
    """Write `files` (name -> contents, config.json last) into `folder`. A new folder appears
    whole or not at all (written beside it, then renamed); a folder that holds anything is
    refused unless `force`, and then these files are replaced, each atomically."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ExportError(f"{folder} is a file, not a folder; choose another folder")
    if folder.is_dir() and any(folder.iterdir()) and not force:
        *most, last = sorted(files)
        names = f"{', '.join(most)} and {last}" if most else last
        raise ExportError(f"{folder} is not empty; choose another folder, or pass --force to "
                          f"replace its {names}")
    if folder.is_dir():
        for name, data in files.items():
            write_bytes_atomic(folder / name, data)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        for name, data in files.items():
            write_bytes_atomic(tmp / name, data)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(folder.parent)
    return folder
