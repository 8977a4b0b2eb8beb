"""Scripts that print figures: training speed and time to a loss, decoding speed.

Usage:
    python -m benchmarks.train --time-to-loss 1.95 --input FILE
    python -m benchmarks.decode --preset baby_gpt --lengths 248
    python -m benchmarks.wallclock -- python ../nanoGPT/train.py ...   # any trainer's pace
    from benchmarks import check_paths; check_paths(input, json_path)   # before the work
    python -m benchmarks.train --input FILE --neighbours 1    # beside one CPU-bound process

Each runs under machine.errors, so a bad input, path or option is one line and exit 1.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cli.options import check_output_file
from data.documents import read_text


def check_paths(input: Path | None = None, json_path: Path | None = None) -> None:
    """A benchmark's paths, checked before its work, as the commands check theirs: the
    input reads as text, and the --json file can be written (figures measured for minutes
    must not be lost to a folder that is not there)."""
    if input is not None:
        read_text(input)
    if json_path is not None:
        check_output_file(json_path, "--json")


@contextmanager
def neighbours(count: int) -> Iterator[None]:
    """`count` CPU-bound processes, each a busy loop, for as long as the block runs: the
    browser, editor or second run that shares a learner's machine. Each is killed at the
    end, however the block ends."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()
