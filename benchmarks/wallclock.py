"""A trainer's speed read from the wall clock: when its log lines arrive.

Usage:
    python -m benchmarks.wallclock -- python train.py config/train_shakespeare_char.py
    python -m benchmarks.wallclock --tokens-per-iter 16384 -- python train.py config/baby_gpt.toml

Runs the command, passing its output through, and notes when each line arrives. A trainer
that prints "iter N" at its log points, after waiting there for the device (nanoGPT's
`loss.item()`; train.py's when its output is not a terminal), is then timed between those
lines: the median ms/iter over consecutive log points, leaving out the spans with any other
line between them (an evaluation, a checkpoint).

The trainer's own figure is not used, because nanoGPT prints the time of the one iteration
before its log point, taken before it waits for the GPU. Its Python may be ahead of the GPU's work by
then, so on a GPU that figure can read faster than the run goes. Both trainers timed this
way are compared on the same clock.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from typing import Annotated

import typer

from machine.errors import UserError, reported, run_command

LOG_POINT = re.compile(r"^iter (\d+)\b")


def log_point_times(lines: list[tuple[float, str]]) -> list[float]:
    """Seconds per iteration between consecutive log points with nothing else between."""
    spans, last = [], None  # last: (time, iteration) of the previous log point
    for t, line in lines:
        match = LOG_POINT.match(line)
        if match is None:
            last = None  # an evaluation or a message, so the span it falls in is not a step's
            continue
        it = int(match.group(1))
        # a line that repeats the iteration (train.py's evaluation, after the work) starts
        # a new span without closing one
        if last is not None and it > last[1]:
            spans.append((t - last[0]) / (it - last[1]))
        last = (t, it)
    return spans


def run_timed(command: list[str]) -> tuple[int, list[tuple[float, str]]]:
    """Run the command with its output unbuffered and echoed; return its exit code and each
    line with its arrival time."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a line arrives when it is printed
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=env, text=True, errors="replace") as proc:
        for line in proc.stdout:
            lines.append((time.perf_counter(), line.strip()))
            sys.stdout.write(line)
    return proc.returncode, lines


def main(
    command: Annotated[list[str], typer.Argument(help="The trainer's command, after --.")],
    tokens_per_iter: Annotated[int | None, typer.Option(
        min=1, help="Tokens per iteration, to print tokens/s too.")] = None,
) -> None:
    """Run a trainer and print its median ms/iter from when its log lines arrive."""
    with reported():
        try:
            rc, lines = run_timed(command)
        except OSError as e:
            raise UserError(f"cannot run {command[0]}: {e.strerror}") from None
        spans = log_point_times(lines)
        if rc != 0:
            raise UserError(f"the command exited with {rc}; nothing timed")
        if len(spans) < 2:
            raise UserError(f"{len(spans)} spans between 'iter N' log lines: too few to time; "
                            f"run more iterations or log more often")
        # the first span holds the first steps' warm-up (compilation's last work, allocation)
        ms = 1000 * statistics.median(spans[1:])
        print(f"wall clock: median {ms:.2f} ms/iter over {len(spans) - 1} spans between "
              f"log points" + (f", {tokens_per_iter / ms * 1000:,.0f} tokens/s"
                               if tokens_per_iter else ""))


if __name__ == "__main__":
    run_command(main)
