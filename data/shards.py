"""The shard format: a token stream cut into files, and the meta.json that makes them a
dataset; ShardWriter writes them for data.prepare, and data/loader.py reads them back, so
that a training run imports only the reading.

Usage:
    from data.shards import ShardWriter
    writer = ShardWriter(out_dir, np.uint16, shard_tokens=100_000_000)
    writer.write(ids[:writer.room()])         # at most room() ids, into the current shard
    entry = writer.commit()                   # names the shard and returns its meta.json entry

A prepared dataset is a folder:

    tokens_000000.bin   token ids, raw little-endian uint16 (uint32 if the vocabulary has
    tokens_000001.bin   more than 65,536 tokens) with no header, so np.memmap reads them as
    ...                 they are. Every shard but the last holds shard_tokens ids. In order,
                        they form one stream: the corpus's documents, one after another, with
                        the tokenizer's separator between them.
    meta.json           written last, so its presence means the dataset is complete:
                        "shards": [{"file", "tokens", "sha256"}, ...], in stream order;
                        "split": {"val_start": N, "rule": ...}: tokens [0, N) are for
                        training, the rest for validation; "train_tokens", "val_tokens", "documents";
                        "max_token": the largest id, checked against "vocab_size" at load;
                        "tokenizer": what rebuilds the tokenizer; "dtype"; "source".

A shard is written under a temporary name and renamed when it is whole, so a file with a
shard's name is always a complete shard. A dataset in the older format without shards
(train.bin and val.bin) is read as two one-shard streams.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from machine.files import fsync_dir

SHARD_NAME = "tokens_{:06d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ShardWriter:
    """Appends token ids to the stream, one shard file at a time."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, index: int = 0) -> None:
        self.folder, self.dtype, self.shard_tokens = Path(folder), np.dtype(dtype), shard_tokens
        self.index, self.file, self.count = index, None, 0
        self.hash = hashlib.sha256()

    def room(self) -> int:
        """How many more ids the current shard takes."""
        return self.shard_tokens - self.count

    def write(self, ids: np.ndarray) -> None:
        """Write ids (at most room()) into the current shard; call commit() when it is full."""
        assert len(ids) <= self.room()
        if self.file is None:
            self.file = open(self.tmp_path(), "wb")
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.count += len(ids)

    def commit(self) -> dict | None:
        """Close the current shard, give it its name, and return its entry for meta.json."""
        if self.file is None:
            return None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        name = SHARD_NAME.format(self.index)
        os.replace(self.tmp_path(), self.folder / name)
        fsync_dir(self.folder)
        entry = {"file": name, "tokens": self.count, "sha256": self.hash.hexdigest()}
        self.index, self.file, self.count = self.index + 1, None, 0
        self.hash = hashlib.sha256()
        return entry

    def discard(self) -> None:
        """Drop the unfinished shard (after an error or an interrupt)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        self.tmp_path().unlink(missing_ok=True)

    def tmp_path(self) -> Path:
        return self.folder / f".{SHARD_NAME.format(self.index)}.tmp"
