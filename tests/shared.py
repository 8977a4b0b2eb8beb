"""Helpers for the shared fixtures: building a fixture's output once for all the xdist
workers of a session, because a trained run takes seconds and each worker would otherwise
build its own; and the conversations that the chat fixtures are made of."""

import random
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder`, built by the first worker that asks for it while the others wait. A marker
    written after the build shows that the folder is complete; a half-built one is built
    again."""
    done = folder.with_name(folder.name + ".done")
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


NAMES = ["ROMEO", "JULIET", "NURSE", "TYBALT"]


def conversation(rng: random.Random) -> dict:
    """Two turns using the test corpus's characters. The second answer repeats the name from
    the first question, so the reply depends on an earlier turn."""
    name = rng.choice(NAMES)
    return {"messages": [{"role": "user", "content": name},
                         {"role": "assistant", "content": f"{name.title()} loves."},
                         {"role": "user", "content": "the name"},
                         {"role": "assistant", "content": name}]}
