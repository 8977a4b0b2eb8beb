"""Files that are whole or absent, folders tried before they are filled, and the cache folder.

Usage:
    from storage import atomic_write, write_bytes_atomic, cache_dir
    with atomic_write(path) as f:          # a binary file object
        torch.save(state, f)
    write_bytes_atomic(path, data)
    cache_dir() / "decode_step"            # $GPTLAB_CACHE, default ~/.cache/gptlab
    probe_writable(run_dir)                # OSError now rather than after an hour

Every file this project writes for later use (checkpoints, prepared bins, exports, fetched
and built files in the cache) goes through atomic_write: a temporary file in the same
folder, fsynced, renamed over the target, and the folder fsynced so the rename itself
survives a power cut. A crash at any moment leaves the old file or the new one, whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def cache_dir() -> Path:
    """Where fetched and built files are kept between runs."""
    return Path(os.environ.get("GPTLAB_CACHE") or Path.home() / ".cache" / "gptlab")


def fsync_dir(folder: Path) -> None:
    """Make the renames in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | Path) -> Iterator[BinaryIO]:
    """A file object whose contents replace `path` only when the block ends without error;
    on any error or interrupt the old file stays and no temporary file is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def probe_writable(folder: Path) -> None:
    """Make `folder` and write a file in it now, so that a place that cannot be written is
    an OSError before the work that would fill it, not after."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / ".write-test"
    probe.write_bytes(b"ok")
    probe.unlink()
