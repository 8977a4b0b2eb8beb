"""Fixtures' outputs built once for every xdist worker of a session: a trained run costs
seconds, and each worker would otherwise build its own; and the conversations the chat
fixtures are made of."""

import random
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder`, built by the first worker that asks while the others wait for it. A marker
    written after the build says it is whole; a half-built folder is built again."""
    done = folder.with_name(folder.name + ".done")
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


NAMES = ["ROMEO", "JULIET", "NURSE", "TYBALT"]


def conversation(rng: random.Random) -> dict:
    """Two turns in the test corpus's characters, the second answer naming the first
    question's name: the reply depends on an earlier turn."""
    name = rng.choice(NAMES)
    return {"messages": [{"role": "user", "content": name},
                         {"role": "assistant", "content": f"{name.title()} loves."},
                         {"role": "user", "content": "the name"},
                         {"role": "assistant", "content": name}]}
