"""A user's error as every command reports it: one line on stderr and an exit code.

Usage:
    from machine.errors import UserError, reported, run_command
    raise UserError("--json is a folder; give a file")   # what is wrong, then the fix
    with reported(debug=debug):                    # "error: <what and the fix>", exit 1
        run_the_command()
    run_command(main)                              # a command's entry point

A UserError is a problem its user can fix (a bad option, a missing file, a damaged
checkpoint); its subclasses name where it arose (training.config.ConfigError,
data.sources.DataError, ...). An OSError that reaches a command is the file system refusing
one of the user's paths. Anything else is a bug and keeps its traceback; --debug shows the
traceback of a reported error too.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click


class UserError(Exception):
    """An error the user can fix; its message says what is wrong, then what to do. A
    command prints "LABEL: message" and exits with exit_code. `everywhere` means that under
    torchrun every process meets this error alike (the same config, the same checkpoint), so
    rank 0 alone reports it."""
    label = "error"
    exit_code = 1
    everywhere = False

    def __init__(self, message: str = "", *, everywhere: bool | None = None) -> None:
        super().__init__(message)
        if everywhere is not None:
            self.everywhere = everywhere


class InputError(UserError, ValueError):
    """A value that a function cannot take (a sampling setting, a prompt, a length), with a
    message for the user who gave it; a ValueError too, as a library's callers expect."""


def error_line(error: Exception) -> str:
    """What a command prints after "error: ": its own error's message, or for an OSError (a
    path too long for the file system, a folder without permission) the path, reason and fix."""
    if not isinstance(error, OSError):
        return str(error)
    where = f" {error.filename}" if error.filename else ""
    if error.errno == errno.ENAMETOOLONG:
        return f"cannot use{where}: a name in it is longer than the file system allows; choose a shorter one"
    return f"cannot use{where} ({error.strerror or error}); check the path and its permissions"


@contextmanager
def reported(debug: bool = False, rank: int = 0) -> Iterator[None]:
    """Report a UserError (or an OSError) raised in the block as "LABEL: <one line>" and
    exit with its code. On a torchrun process other than rank 0, an error that every
    process meets is left to rank 0 to report; the process exits with its code all the same."""
    try:
        yield
    except (UserError, OSError) as e:
        if debug:
            raise
        if rank == 0 or not getattr(e, "everywhere", False):
            print(f"{getattr(e, 'label', 'error')}: {error_line(e)}", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", 1)) from None


def run_command(main: Callable[..., object] | click.Command) -> None:
    """A command's entry point: read the command line into `main` (a click command, or a
    function whose parameters typer reads) and run it. A usage error (an unknown option, a
    value out of its range) is one line and exit 2, where click prints a box of lines; so is
    an output that cannot be written (a full disk, `> /dev/full`, a closed pipe), exit 1."""
    if isinstance(main, click.Command):
        command, usage_errors, aborts = main, (click.ClickException,), (click.Abort,)
    else:  # typer is imported only by the commands declared with it
        from machine.typer_commands import typer_command
        command, usage_errors, aborts = typer_command(main)
    try:
        code = command.main(standalone_mode=False)  # the exit code of --help, or None
        sys.stdout.flush()
    except usage_errors as e:
        where = e.ctx.command_path if getattr(e, "ctx", None) else command.name
        print(f"error: {' '.join(e.format_message().split())} (see {where} --help)", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except aborts:  # Ctrl-C before the command set up its own handling
        raise SystemExit(130) from None
    except OSError as e:
        # the output failed (a full or failing disk); an error that names a file is its writer's to report
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EIO, errno.EPIPE) or e.filename:
            raise
        # the interpreter flushes stdout once more as it exits, so send that write nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: cannot write the output ({e.strerror or e}); send it to a file or "
              f"a disk with space", file=sys.stderr)
        raise SystemExit(1) from None
    if code:
        raise SystemExit(code)
