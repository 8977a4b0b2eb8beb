"""Read prepared datasets: meta.json, checked, and each split's tokens, memory-mapped
(data/shards.py describes the format and writes it); data/batches.py draws from them.

Usage:
    from data.loader import load_dataset
    meta, splits, tokenizer = load_dataset("data/shakespeare_char")
    splits["train"][0:65]     # the first 65 token ids, an ndarray, read and checked when asked for
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data.sources import DataError
from data.tokenizer import Tokenizer, load_tokenizer, tokenizer_problem
from machine.files import record_problem

SPLITS = ("train", "val")
META_FIELDS = {"tokenizer": dict, "vocab_size": int, "dtype": str, "train_tokens": int,
               "val_tokens": int}


def load_meta(data_dir: str | Path) -> dict:
    """The dataset's meta.json. Prepare writes it last, so if it exists the dataset is complete."""
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise DataError(f"no prepared dataset in {data_dir} (meta.json missing); "
                        f"run: python -m data.prepare --input YOUR_TEXT --out {data_dir}")
    again = f"prepare the dataset again (python -m data.prepare ... --out {data_dir})"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # or nested too deeply
        raise DataError(f"{path} is not valid JSON; {again}") from None
    problem = record_problem(meta, META_FIELDS)
    if problem:
        raise DataError(f"{path} is damaged: {problem}; {again}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path} names an unknown dtype ({meta['dtype']!r}); {again}")
    problem = tokenizer_problem(meta["tokenizer"])
    if problem or meta["tokenizer"]["vocab_size"] != meta["vocab_size"]:
        problem = problem or (f"its vocab_size is {meta['tokenizer']['vocab_size']}, the "
                              f"dataset's {meta['vocab_size']}")
        raise DataError(f"{path} is damaged: the tokenizer's description: {problem}; {again}")
    if "shards" in meta:  # the sharded format (data/shards.py)
        shards, split = meta["shards"], meta.get("split")
        whole = isinstance(shards, list) and all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("tokens"), int)
            for s in shards) and isinstance(split, dict) and isinstance(split.get("val_start"), int) \
            and isinstance(meta.get("max_token"), int)
        if not whole:
            raise DataError(f"{path} has a damaged shard list or split; {again}")
    return meta


def open_shards(folder: str | Path, meta: dict) -> list[np.ndarray]:
    """Each shard of the stream, memory-mapped, after checking that it has the size that
    meta.json gives it. That check is a stat, not a read, so opening costs the same at any size."""
    dtype = np.dtype(meta["dtype"])
    pieces = []
    for shard in meta["shards"]:
        path = Path(folder) / shard["file"]
        expected = shard["tokens"] * dtype.itemsize
        if not path.exists() or path.stat().st_size != expected:
            raise DataError(f"{path} is missing or not {expected} bytes as meta.json says; "
                            f"prepare the dataset again")
        pieces.append(np.memmap(path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype))
    return pieces


class Tokens:
    """The token ids of one split: a range of memory-mapped pieces that reads like one
    array. `tokens[a:b]` gives the ids at positions a to b-1 as an ndarray, reading only those.

    Every read is checked against the vocabulary. The ids were checked when the dataset was
    prepared; this catches a shard damaged since, which would otherwise index outside the
    embedding table. The cost is one max over the ids read, small next to a training step."""

    def __init__(self, pieces: list[np.ndarray], vocab_size: int, where: str,
                 split: str) -> None:
        self.pieces = [p for p in pieces if len(p)]
        self.ends = np.cumsum([len(p) for p in self.pieces])  # where each piece stops
        self.dtype = pieces[0].dtype if pieces else np.dtype(np.uint16)
        self.vocab_size, self.where, self.split = vocab_size, where, split

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        assert step == 1, "Tokens read contiguous ranges"
        first = int(np.searchsorted(self.ends, start, side="right"))
        parts = []
        while start < stop:
            begin = int(self.ends[first - 1]) if first else 0
            part = self.pieces[first][start - begin:stop - begin]
            parts.append(part)
            start += len(part)
            first += 1
        if not parts:
            return np.zeros(0, self.dtype)
        ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if ids.max() >= self.vocab_size:
            raise DataError(f"{self.where} holds token id {int(ids.max())}, outside the "
                            f"vocabulary of {self.vocab_size} in meta.json; a shard is "
                            f"damaged: prepare the dataset again")
        return ids


def stream_range(pieces: list[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
    """The pieces that cover tokens [start, stop) of the stream, sliced without reading them."""
    out, begin = [], 0
    for piece in pieces:
        end = begin + len(piece)
        if end > start and begin < stop:
            out.append(piece[max(start - begin, 0):min(stop, end) - begin])
        begin = end
    return out


def load_split(data_dir: str | Path, split: str, meta: dict | None = None) -> Tokens:
    """Token ids of one split, memory-mapped: nothing is read until a batch needs it."""
    meta = meta or load_meta(data_dir)
    if "shards" not in meta:  # the unsharded format: train.bin and val.bin
        legacy = {"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}
        pieces = open_shards(data_dir, {**meta, "shards": [legacy]})
        return Tokens(pieces, meta["vocab_size"], str(data_dir), split)
    if meta["max_token"] >= meta["vocab_size"]:
        raise DataError(f"{data_dir} holds token id {meta['max_token']}, outside the vocabulary "
                        f"of {meta['vocab_size']} in meta.json; prepare the dataset again")
    pieces = open_shards(data_dir, meta)
    cut = meta["split"]["val_start"]
    span = (0, cut) if split == "train" else (cut, cut + meta["val_tokens"])
    return Tokens(stream_range(pieces, *span), meta["vocab_size"], str(data_dir), split)


def load_dataset(data_dir: str | Path) -> tuple[dict, dict[str, Tokens], Tokenizer]:
    """A prepared dataset: its meta.json, its splits memory-mapped, and its tokenizer."""
    meta = load_meta(data_dir)
    splits = {split: load_split(data_dir, split, meta) for split in SPLITS}
    try:
        tokenizer = load_tokenizer(meta["tokenizer"])
    except ValueError as e:
        raise DataError(f"{data_dir}/meta.json: {e}; prepare the dataset again") from None
    return meta, splits, tokenizer
