"""Read prepared datasets and draw random training windows from them.

Usage:
    from data.loader import load_meta, load_split, get_batch
    meta = load_meta("data/shakespeare_char")
    train = load_split("data/shakespeare_char", "train")   # np.memmap of token ids
    x, y = get_batch(train, block_size=64, batch_size=12, generator=torch.Generator())
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from data.sources import DataError
from tokenizer import TOKENIZERS

SPLITS = ("train", "val")
META_KEYS = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens")


def load_meta(data_dir: str | Path) -> dict:
    """The dataset's meta.json, written last by prepare, so its presence means complete."""
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise DataError(f"no prepared dataset in {data_dir} (meta.json missing); "
                        f"run: python -m data.prepare --input YOUR_TEXT --out {data_dir}")
    again = f"prepare the dataset again (python -m data.prepare ... --out {data_dir})"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{path} is not valid JSON; {again}") from None
    missing = [key for key in META_KEYS if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {again}")
    if meta["dtype"] not in ("uint16", "uint32") or not isinstance(meta["tokenizer"], dict) \
            or meta["tokenizer"].get("kind") not in TOKENIZERS:
        raise DataError(f"{path} names an unknown dtype ({meta['dtype']!r}) or tokenizer "
                        f"({meta['tokenizer']!r:.60}); {again}")
    return meta


def load_split(data_dir: str | Path, split: str, meta: dict | None = None) -> np.memmap:
    """Token ids of one split, memory-mapped: nothing is read until a batch needs it."""
    meta = meta or load_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    dtype = np.dtype(meta["dtype"])
    expected = meta[f"{split}_tokens"] * dtype.itemsize
    if not path.exists() or path.stat().st_size != expected:
        raise DataError(f"{path} is missing or not {expected} bytes as meta.json says; "
                        f"prepare the dataset again")
    data = np.memmap(path, dtype=dtype, mode="r")
    # an id past the vocabulary would index outside the embedding table mid-training;
    # one pass over the bins (milliseconds for megabytes) finds it now
    if len(data) and int(data.max()) >= meta["vocab_size"]:
        raise DataError(f"{path} holds token id {int(data.max())}, outside the vocabulary of "
                        f"{meta['vocab_size']} in meta.json; prepare the dataset again")
    return data


def get_batch(data: np.ndarray, block_size: int, batch_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size random windows: inputs x and next-token targets y, both (B, block_size) int64."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator).numpy()
    offsets = starts[:, None] + np.arange(block_size + 1)  # (B, block_size + 1)
    chunk = torch.from_numpy(data[offsets].astype(np.int64))  # one gather from the memmap
    return chunk[:, :-1], chunk[:, 1:]


class BatchStream:
    """One process's stream of random training batches.

    Under torchrun every process draws the same stream and takes every world_size-th
    batch, so N processes train on exactly the batches that one process with N times the
    gradient accumulation would. `state` is the generator as it was before the batch drawn
    last: a checkpoint stores it, so a resumed run draws that batch again and then exactly
    the batches this run would have drawn next.
    """

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        self.data, self.block_size, self.batch_size = data, block_size, batch_size
        self.rank, self.world_size = rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.state = self.generator.get_state()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.state = self.generator.get_state()
        for r in range(self.world_size):
            batch = get_batch(self.data, self.block_size, self.batch_size, self.generator)
            if r == self.rank:
                mine = batch
        return mine

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
