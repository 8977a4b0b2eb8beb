"""The output folder of data.prepare: claimed for one command, locked while it runs, and
resumed by the same command after an interruption.

Usage:
    from data.folder import claim, fingerprint, locked
    plan = fingerprint(inputs, recipe, text_field, val_fraction, shard_tokens, batch_bytes)
    with locked(out) as out:                      # DataError while another command holds it
        done, progress = claim(out, plan, force)  # a finished dataset, or where to resume

A folder is ours to write when it is empty, holds a dataset prepared with the same plan (its
fingerprint: inputs, tokenizer, options), or holds one of another plan and --force is given.
A folder holding anything else (another tool's train.bin, a dataset of other inputs, any
file) is refused, so that no command deletes what it did not write.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data.assets import sha256_bytes
from data.documents import Input
from data.sources import DataError
from machine.files import lock_folder, write_bytes_atomic

PROGRESS, DOCUMENTS, LOCK = ".prepare.json", ".documents.bin", ".prepare.lock"
FORMAT = 2  # the version of meta.json's layout; 2 is the sharded stream (data/shards.py)


def fingerprint(inputs: list[Input], tokenizer: dict, text_field: str, val_fraction: float,
                shard_tokens: int, batch_bytes: int) -> dict:
    """Everything that decides the bytes, so the same fingerprint means the same dataset."""
    files = [[i.name, i.size, sha256_bytes(i.data) if i.data is not None
              else os.stat(i.name).st_mtime_ns] for i in inputs]
    return {"format": FORMAT, "inputs": files, **tokenizer, "text_field": text_field,
            "val_fraction": val_fraction, "shard_tokens": shard_tokens, "batch_bytes": batch_bytes}


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def claim(out: Path, plan: dict, force: bool) -> tuple[dict | None, dict | None]:
    """(meta of a finished identical dataset, progress of an unfinished one) in `out`,
    after refusing, or with force clearing, a dataset that another command made."""
    meta, progress = read_json(out / "meta.json"), read_json(out / PROGRESS)
    if meta is not None and meta.get("prepared_with") == plan:
        return meta, None
    if progress is not None and progress.get("prepared_with") == plan and meta is None:
        return None, progress
    foreign = sorted(p.name for p in out.iterdir() if not ours(p.name))
    if (meta is not None or progress is not None or foreign) and not force:
        what = (f"another dataset ({differs(meta.get('prepared_with'), plan)})"
                if meta is not None else
                "an unfinished dataset of other inputs" if progress is not None else
                f"files that are no dataset of ours ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''})")
        raise DataError(f"{out} holds {what}; choose another --out, or add --force to "
                        f"replace it")
    remove_dataset(out)
    return None, None


def differs(made: object, plan: dict) -> str:
    """How the folder's dataset differs from the one this command would make: other
    settings, other input files, or the same files changed since it was made."""
    if not isinstance(made, dict):
        return "made by an older version"
    inputs = made.get("inputs")
    if inputs == plan["inputs"]:
        return "other settings"
    names = [i[0] if isinstance(i, list) and i else None for i in inputs or []]
    if isinstance(inputs, list) and names == [i[0] for i in plan["inputs"]]:
        return "the same files before they changed"
    return "other input files"


def ours(name: str) -> bool:
    """Whether a file of this name is one that prepare writes (a dataset in the older
    format, train.bin and val.bin, has a meta.json too)."""
    return name in ("meta.json", PROGRESS, DOCUMENTS, LOCK) or \
        name.startswith(("tokens_", ".tokens_"))


def remove_dataset(out: Path) -> None:
    """Delete what prepare writes in `out` (and nothing else)."""
    if not out.is_dir():
        return
    for path in out.iterdir():
        if path.name != LOCK and (ours(path.name) or path.name in ("train.bin", "val.bin")):
            path.unlink()


def save_progress(out: Path, progress: dict) -> None:
    write_bytes_atomic(out / PROGRESS, json.dumps(progress).encode())


@contextmanager
def locked(out: Path) -> Iterator[Path]:
    """The output folder, made if missing and locked for this command (a second command
    writing into it is refused while this one runs). A command that stops leaves no lock file or folder of
    its own making behind, unless it wrote something; a file system error is a DataError
    that says where, and that the same command resumes."""
    out.exists()  # raises for a name the file system refuses (too long), reported as that
    try:
        held = lock_folder(out, LOCK)
    except OSError as e:
        raise DataError(f"cannot write the dataset to {out} ({e.strerror}); choose another "
                        f"--out") from None
    if held is None:
        raise DataError(f"{out} is being prepared by another command that is still going; "
                        f"wait for it to end, or choose another --out")
    try:
        yield out
    except BaseException as e:
        held.release(undo=True)  # removes the lock file and folder if made now and left empty
        if isinstance(e, OSError):
            raise DataError(f"cannot write the dataset to {out} ({e.strerror}); free some "
                            f"space or choose another --out, then run the same command "
                            f"again: it resumes after the last whole shard") from None
        raise
    held.release()
