"""Files that are whole or absent, folders tried before they are filled, and the cache folder.

Usage:
    from machine.files import atomic_write, write_bytes_atomic, cache_dir, record_problem
    with atomic_write(path) as f:          # a binary file object
        torch.save(state, f)
    write_bytes_atomic(path, data)
    cache_dir() / "decode_step"            # $GPTLAB_CACHE, ~/.cache/gptlab, or a private temp folder
    probe_writable(run_dir)                # OSError now rather than after an hour
    held = lock_folder(out, ".lock")       # None while another live process holds it

Every file this project writes for later use (plain checkpoints, exports, fetched and built
files in the cache) goes through atomic_write, and a prepared shard is written alike: a
temporary file in the same folder, fsynced, renamed over the target, and the folder fsynced
so the rename survives a power cut. A crash at any moment leaves the old file or the new one.
"""

from __future__ import annotations

import fcntl
import glob
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from machine.errors import UserError


def cache_dir() -> Path:
    """Where fetched and built files are kept between runs: $GPTLAB_CACHE, else
    ~/.cache/gptlab, else, for a user with no home (as in a container run with --user), a
    private folder in the temporary folder. That one is checked, because a folder that
    another user made first could hold a library that the C decode step would load."""
    if os.environ.get("GPTLAB_CACHE"):
        return Path(os.environ["GPTLAB_CACHE"])
    with suppress(RuntimeError):  # Path.home() finds neither HOME nor a passwd entry
        return Path.home() / ".cache" / "gptlab"
    folder = Path(tempfile.gettempdir()) / f"gptlab-cache-{os.getuid()}"
    with suppress(OSError):
        folder.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(folder) if folder.is_dir() else None  # a link's own mode is 0o777
    if info is None or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UserError(f"this user has no home folder for the cache, and {folder} is not a "
                        f"private folder of its own; set GPTLAB_CACHE to a folder you can write")
    return folder


def cache_unusable(error: OSError) -> str:
    """One line for a cache folder that cannot be used (GPTLAB_CACHE names a file, or a
    folder this process cannot write), and the fix."""
    why = "it is a file" if cache_dir().is_file() else error.strerror or str(error)
    return (f"the cache folder {cache_dir()} cannot be used ({why}); set GPTLAB_CACHE to a "
            f"folder you can write")


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
    otherwise the old file stays. The temporary file is named after this process, so that
    processes writing one file (the cache) never write into each other's."""
    path = Path(path)
    prefix = f".{path.name}."
    for stale in path.parent.glob(glob.escape(prefix) + "*.tmp"):  # files that killed writers left
        with suppress(ValueError, PermissionError):  # not a pid, or another user's process
            try:
                os.kill(int(stale.name[len(prefix):-len(".tmp")]), 0)  # only checks that it is alive
            except ProcessLookupError:
                stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{prefix}{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        failure = write_failure(e)
        if failure is e:
            raise
        raise failure from None
    fsync_dir(path.parent)


def write_failure(error: BaseException) -> BaseException:
    """The OSError behind a failed write, where a writer wrapped it (torch.save's zip writer
    raises a RuntimeError for a full disk), so that callers report every one in one line."""
    if not isinstance(error, RuntimeError):
        return error
    cause = error.__cause__ or error.__context__
    return cause if isinstance(cause, OSError) else error


@contextmanager
def quiet_writer_threads() -> Iterator[None]:
    """Silence OSErrors in threads, because TensorBoard's writer thread prints a traceback for
    a full disk that the main thread meets at its next write and reports in one line."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not issubclass(args.exc_type, OSError):
            previous(args)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def record_problem(record: object, fields: dict[str, type | tuple[type, ...]]) -> str | None:
    """What is wrong with a record read from disk (meta.json, a checkpoint, a tokenizer's
    description): the first of `fields` that it lacks or that is not of its type, in a few
    words that name the key; None if nothing is. A bool does not count as a number here."""
    if not isinstance(record, dict):
        return f"it is a {type(record).__name__}, not a record of keys"
    for key, kind in fields.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if key not in record:
            return f"it lacks {key}"
        value = record[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return f"its {key} is {value!r:.40}, not of type {' or '.join(k.__name__ for k in kinds)}"
    return None


def probe_writable(folder: Path) -> None:
    """Make `folder` and write a file in it now, so that a place that cannot be written is
    an OSError before the work that would fill it, not after."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / ".write-test"
    probe.write_bytes(b"ok")
    probe.unlink()


@dataclass
class FolderLock:
    """A folder whose lock this process holds, and what taking the lock created."""
    path: Path
    lock: IO
    made: list[Path]  # folders and the lock file, in the order they were made

    def release(self, undo: bool = False) -> None:
        """Drop the lock. With undo, first remove what taking it made, so that a command that
        fails before it writes anything leaves nothing behind."""
        if undo:
            for path in reversed(self.made):
                with suppress(OSError):
                    path.rmdir() if path.is_dir() else path.unlink()
        self.lock.close()


def lock_folder(folder: Path, name: str) -> FolderLock | None:
    """Make `folder` and take its lock, or return None if another live process holds it.
    The lock is an flock on the empty file folder/name, which the kernel drops when its
    holder exits, however it exits."""
    made = [f for f in (*reversed(folder.parents), folder) if not f.exists()]
    if not (folder / name).exists():
        made.append(folder / name)
    folder.mkdir(parents=True, exist_ok=True)
    held = FolderLock(folder, open(folder / name, "a+"), made)
    try:
        fcntl.flock(held.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.lock.close()
        return None
    return held
