"""A command declared as a function whose parameters typer reads, turned into the click
command that typer would run, with the classes of the errors that command raises.

Usage:
    command, usage_errors, aborts = typer_command(main)   # as machine.errors.run_command does
"""

from __future__ import annotations

from collections.abc import Callable

import click
import typer


def typer_command(main: Callable[..., object]) -> tuple[click.Command, tuple, tuple]:
    """The command that typer.run(main) runs, the classes of its usage errors, and those of
    its Ctrl-C. Recent versions of typer carry their own copy of click, whose errors derive
    from TyperException; older versions raise click's own."""
    app = typer.Typer(add_completion=False)
    app.command()(main)
    usage_errors = (click.ClickException, getattr(typer, "TyperException", click.ClickException))
    return typer.main.get_command(app), usage_errors, (click.Abort, typer.Abort)
