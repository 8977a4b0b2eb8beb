"""A user's error as every command reports it: one line on stderr and an exit code, never
a traceback.

Usage:
    from machine.errors import reported, run_command
    with reported(ValueError, OSError, debug=debug):   # "error: <what and the fix>", exit 1
        run_the_command()
    run_command(app)                                    # a command's entry point

A command names the kinds of error that are its user's to fix (a bad option, a missing
file, a full disk); anything else is a bug, and keeps its traceback. --debug shows the
traceback of a reported error too.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def error_line(error: Exception) -> str:
    """What a command prints after "error: " for a failure it reports in one line: the
    message of its own errors; for an OSError that reached it (a path too long for the file
    system, a folder without permission), the path, the reason and the fix."""
    if not isinstance(error, OSError):
        return str(error)
    where = f" {error.filename}" if error.filename else ""
    if error.errno == errno.ENAMETOOLONG:
        return (f"cannot use{where}: a name in it is longer than the file system allows; "
                f"choose a shorter one")
    return f"cannot use{where} ({error.strerror or error}); check the path and its permissions"


@contextmanager
def reported(*kinds: type[BaseException], debug: bool = False,
             quiet: Callable[[BaseException], bool] = lambda error: False) -> Iterator[None]:
    """Report an error of one of `kinds` raised in the block as "LABEL: <one line>" and exit
    with its code. An error may carry its own: `label` (default "error") and `exit_code`
    (default 1). `quiet(error)` true prints nothing and exits all the same: the processes
    under torchrun that rank 0 speaks for."""
    try:
        yield
    except kinds as e:
        if debug:
            raise
        if not quiet(e):
            print(f"{getattr(e, 'label', 'error')}: {error_line(e)}", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", 1)) from None


def run_command(command: Callable[[], object]) -> None:
    """A command's entry point: run it, and if its output cannot be written (stdout on a full
    disk, `> /dev/full`, a pipe closed early), say so in one line on stderr and exit 1,
    rather than end in a traceback. What the command wrote to files before is kept."""
    try:
        command()
        sys.stdout.flush()
    except OSError as e:
        if not stdout_failed(e):
            raise
        # the interpreter flushes stdout once more as it exits: let that write go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: cannot write the output ({e.strerror or e}); send it to a file or "
              f"a disk with space", file=sys.stderr)
        raise SystemExit(1) from None


def stdout_failed(error: OSError) -> bool:
    """Whether an error that reached the top is a failed write of the output: the disk is
    full or the device fails, and no file is named (a file the command writes is reported
    by the command itself, in its own words)."""
    return (error.errno in (errno.ENOSPC, errno.EFBIG, errno.EIO, errno.EPIPE)
            and error.filename is None)
