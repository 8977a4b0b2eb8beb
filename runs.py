"""The run folder: which one a run writes to, whether it can, whether a checkpoint in it
can be resumed, and how a run stops cleanly.

Usage:
    from runs import choose_run_dir, check_writable, check_resumable, stop_signals
    run_dir = choose_run_dir(cfg, resume=False)      # runs/quickstart, or runs/quickstart-2
    check_writable(run_dir, checkpoint_bytes)
    check_resumable(ckpt, model, meta, cfg, run_dir / "last.pt")
    with stop_signals() as stop: ...                  # stop["signal"] once Ctrl-C arrives
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from model import GPT
from storage import probe_writable
from train_config import ConfigError, TrainConfig


def saved_nothing(run_dir: Path) -> bool:
    """Whether run_dir holds only the TensorBoard events of a run that died before its first
    checkpoint (killed, or a second Ctrl-C while it started): nothing worth keeping."""
    files = list(run_dir.iterdir())
    return bool(files) and all(f.is_file() and f.name.startswith("events.out.tfevents.")
                               for f in files)


def choose_run_dir(cfg: TrainConfig, resume: bool) -> Path:
    """runs/<run_name>; a new run never writes into an old run's folder (it takes the next
    free -2, -3, ... name instead), a resumed run must find its last.pt there. A folder
    where a run saved nothing is taken over, its stale events deleted, so that a run killed
    in its first seconds does not push the next one to -2."""
    base = Path(cfg.out_dir) / (cfg.run_name or "run")
    if base.exists() and not base.is_dir():
        raise ConfigError(f"{base} is a file, not a run folder; choose another --run-name "
                          f"or --out-dir")
    if resume:
        if not (base / "last.pt").is_file():
            raise ConfigError(f"nothing to resume: {base / 'last.pt'} not found; "
                              f"drop --resume to start a new run")
        return base
    run_dir, n = base, 1
    while run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())
                                and not saved_nothing(run_dir)):
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    if run_dir.exists() and saved_nothing(run_dir):
        for events in run_dir.iterdir():
            events.unlink()
    return run_dir


def check_writable(run_dir: Path, checkpoint_bytes: int) -> None:
    """Fail before training rather than at the first checkpoint: the folder must take a
    file, and the disk must hold last.pt, best.pt and one temporary copy."""
    try:
        probe_writable(run_dir)
    except OSError as e:
        raise ConfigError(f"cannot write to {run_dir} ({e.strerror}); choose another --out-dir") from None
    free = shutil.disk_usage(run_dir).free
    if free < 3 * checkpoint_bytes:
        raise ConfigError(f"{run_dir} has {free / 1e6:.0f} MB free but checkpoints need about "
                          f"{3 * checkpoint_bytes / 1e6:.0f} MB; free space or choose another --out-dir")


@contextmanager
def stop_signals() -> Iterator[dict[str, int]]:
    """While active, SIGINT and SIGTERM only set stop["signal"], so the loop can finish its
    step and save. A second Ctrl-C interrupts at once, as usual."""
    stop: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        stop["signal"] = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def check_resumable(ckpt: dict, model: GPT, meta: dict, cfg: TrainConfig, path: Path) -> None:
    """Refuse to resume with other data, a different model shape or another optimizer."""
    saved_optimizer = ckpt["config"].get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(f"cannot resume: {path} was trained with optimizer = "
                          f"{saved_optimizer}, not {cfg.optimizer}; resume with --optimizer "
                          f"{saved_optimizer}, or start a new run")
    if ckpt["tokenizer"] != meta["tokenizer"]:
        raise ConfigError(f"cannot resume: {path} was trained with another tokenizer or "
                          f"vocabulary than the {meta['tokenizer']['kind']} data in data_dir; "
                          f"use the run's original data_dir")
    for key, value in ckpt["model_args"].items():
        if getattr(model.config, key) != value:
            raise ConfigError(f"cannot resume: {key} is {getattr(model.config, key)} in the "
                              f"config but {value} in {path}; use the run's original settings")
