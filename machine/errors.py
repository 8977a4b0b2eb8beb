"""A user's error as every command reports it: one line on stderr and an exit code, never
a traceback.

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
    """A value that a function cannot take, with a message written for the user who gave
    it (a sampling setting, a prompt, a length). It is a ValueError too, as Python callers
    of a library expect."""


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
    """A command's entry point: read the command line into `main` (a function whose
    parameters typer reads, or a click command) and run it. A usage error (an unknown
    option, a value of the wrong type or out of its range) is one line and exit 2, as
    argparse's is, where click would print a box of several lines. An output that cannot be
    written (stdout on a full disk, `> /dev/full`, a pipe closed early) is one line and exit
    1, rather than a traceback. What the command wrote to files before is kept."""
    usage_error: tuple[type[Exception], ...] = (click.ClickException,)
    abort: tuple[type[Exception], ...] = (click.Abort,)
    if isinstance(main, click.Command):
        command = main
    else:
        import typer  # only a command declared with typer's parameters needs it

        app = typer.Typer(add_completion=False)
        app.command()(main)  # as typer.run(main) does
        command = typer.main.get_command(app)
        # recent versions of typer carry their own copy of click, whose errors derive from
        # TyperException; older versions raise click's own
        usage_error += (getattr(typer, "TyperException", click.ClickException),)
        abort += (typer.Abort,)
    try:
        # click returns the exit code of --help or of a typer.Exit, and None otherwise
        code = command.main(standalone_mode=False)
        sys.stdout.flush()
    except usage_error as e:
        where = e.ctx.command_path if getattr(e, "ctx", None) else command.name
        message = " ".join(e.format_message().split())  # one line, wherever click wrapped it
        print(f"error: {message} (see {where} --help)", file=sys.stderr)
        raise SystemExit(getattr(e, "exit_code", 2)) from None
    except abort:  # Ctrl-C before the command set up its own handling
        raise SystemExit(130) from None
    except OSError as e:
        if not stdout_failed(e):
            raise
        # the interpreter flushes stdout once more as it exits, so send that write nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: cannot write the output ({e.strerror or e}); send it to a file or "
              f"a disk with space", file=sys.stderr)
        raise SystemExit(1) from None
    if code:
        raise SystemExit(code)


def stdout_failed(error: OSError) -> bool:
    """Whether an error that reached the top is a failed write of the output: the disk is
    full or the device fails, and no file is named (a file the command writes is reported
    by the command itself, in its own words)."""
    return (error.errno in (errno.ENOSPC, errno.EFBIG, errno.EIO, errno.EPIPE)
            and error.filename is None)
