"""Train a GPT on a prepared corpus, with TensorBoard logs, evaluation and checkpoints.

Usage:
    python train.py --config config/quickstart.toml               # char-level Shakespeare, CPU
    python train.py --config config/quickstart.toml --max-iters 500 --n-layer 2
    python train.py --config config/quickstart.toml --resume      # continue runs/quickstart
    tensorboard --logdir runs

Every field of TrainConfig (training/config.py) is also a command-line option. A run writes
runs/<run_name>/: TensorBoard events, last.pt (every evaluation) and best.pt (best val loss).
"""

from __future__ import annotations

import inspect
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from machine.errors import reported, run_command
from training import distributed
from training.config import cli_parameters, load_config
from training.loop import train


def build_cli() -> typer.Typer:
    """A typer command with --config, --resume, --debug and one option per TrainConfig field
    (default None: only what is given on the command line overrides the config file)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]})

    def command(**kwargs: Any) -> None:
        config, resume, debug = kwargs.pop("config"), kwargs.pop("resume"), kwargs.pop("debug")
        overrides = {key: value for key, value in kwargs.items() if value is not None}
        rank = distributed.environment().rank  # under torchrun, rank 0 reports
        is_main = rank == 0
        try:
            with reported(debug=debug, rank=rank):
                cfg = load_config(config, overrides)
                if not cfg.run_name:
                    cfg.run_name = config.stem if config else "run"
                result = train(cfg, resume)
        except KeyboardInterrupt:  # a second Ctrl-C, which stops at once (training/runs.stop_signals)
            if is_main:
                typer.echo("interrupted: stopped at once by a second Ctrl-C; the last "
                           "checkpoint, if any, is intact", err=True)
            raise typer.Exit(128 + signal.SIGINT) from None
        if is_main:
            ext = result.checkpoint.suffix if result.checkpoint else ".pt"  # .dcp: under FSDP
            plain = f"python export.py {result.run_dir} --plain, then " if ext == ".dcp" else ""
            typer.echo(f"done: {result.iter_num} iters in {result.wall_time:.0f}s, "
                       f"best val loss {result.best_val_loss:.4f}\n"
                       f"checkpoints: {result.run_dir}/best{ext}, {result.run_dir}/last{ext}\n"
                       f"next: {plain}python sample.py --run {result.run_dir}"
                       f"{' --chat' if result.chat else ''}   |   "
                       f"tensorboard --logdir {result.run_dir.parent}")

    params = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Annotated[Path | None, typer.Option(
                              help="TOML preset; see config/. Its keys are the options below.")]),
        inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=False,
                          annotation=Annotated[bool, typer.Option(
                              help="Continue runs/<run_name> from its last.pt.")]),
        inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=False,
                          annotation=Annotated[bool, typer.Option(
                              help="Show tracebacks for configuration and data errors.")]),
        *cli_parameters(),
    ]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = "Train a GPT. Settings: TrainConfig defaults < --config file < options."
    app.command()(command)
    return app


if __name__ == "__main__":
    run_command(build_cli())
