"""The run folder: which one a run writes to, whether it can, whether a checkpoint in it
can be resumed, and how a run stops cleanly.

Usage:
    from training.runs import choose_run_dir, check_writable, check_resumable, stop_signals
    folder = choose_run_dir(cfg, resume=False)  # runs/quickstart (or -2), locked
    check_writable(folder.path, checkpoint_bytes)
    check_resumable(saved, model, meta, cfg, folder.path / "last.pt")  # saved: a TrainState
    with stop_signals() as stop: ...            # stop["signal"] once Ctrl-C arrives
    folder.release()                            # when the run ends
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from machine.files import FolderLock, lock_folder, probe_writable
from model import GPT
from training.config import ConfigError, TrainConfig
from weights.checkpoint import TrainState

LOCK = ".lock"


def saved_nothing(run_dir: Path) -> bool:
    """Whether run_dir holds only its lock and the TensorBoard events of a run that died
    before its first checkpoint (killed, or a second Ctrl-C while it started): nothing worth
    keeping. Ask only while holding the folder's lock, or a live run's start looks so too."""
    files = list(run_dir.iterdir())
    return bool(files) and all(f.is_file() and (f.name == LOCK or
                                                f.name.startswith("events.out.tfevents."))
                               for f in files)


RunFolder = FolderLock  # a run folder whose lock this process holds


def lock_run_dir(run_dir: Path) -> RunFolder | None:
    """Make run_dir and take its lock (machine.files.lock_folder), or None if another live
    run holds it. Hold it for as long as the run writes to the folder."""
    return lock_folder(run_dir, LOCK)


def choose_run_dir(cfg: TrainConfig, resume: bool) -> RunFolder:
    """runs/<run_name>, its lock held. A new run never writes into another run's folder, old
    or live: it takes the next free -2, -3, ... name instead. A resumed run must find its
    last.pt there and no live run. A folder where a run saved nothing is taken over, its
    stale events deleted, so that a run killed in its first seconds does not push the next
    one to -2."""
    base = Path(cfg.out_dir) / (cfg.run_name or "run")
    if base.exists() and not base.is_dir():
        raise ConfigError(f"{base} is a file, not a run folder; choose another --run-name "
                          f"or --out-dir")
    try:
        if resume:
            if not any((base / name).exists() for name in ("last.pt", "last.dcp")):
                raise ConfigError(f"nothing to resume: {base / 'last.pt'} not found; "
                                  f"drop --resume to start a new run")
            folder = lock_run_dir(base)
            if folder is None:
                raise ConfigError(f"{base} is in use by a run that is still going; wait "
                                  f"for it to end, or start a new run without --resume")
            return folder
        for n in range(1, 10_000):
            run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
            if run_dir.exists() and not run_dir.is_dir():
                continue
            folder = lock_run_dir(run_dir)
            if folder is None:
                continue  # a live run's folder
            if saved_nothing(run_dir):  # new, or a run's that died before saving
                for f in run_dir.iterdir():
                    if f.name != LOCK:
                        f.unlink()
                return folder
            folder.release(undo=True)  # an old run's: as it was
    except OSError as e:
        raise ConfigError(f"cannot write to {e.filename or base} ({e.strerror}); choose "
                          f"another --out-dir or --run-name") from None
    raise ConfigError(f"{base} and 9,999 numbered folders beside it are taken; choose "
                      f"another --run-name")


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
    """While active, SIGINT, SIGTERM and SIGHUP (the terminal or SSH session closed) only
    set stop["signal"], so the loop can finish its
    step and save. A second Ctrl-C interrupts at once, as usual."""
    stop: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        stop["signal"] = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {s: signal.signal(s, handler)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# What a resumed run cannot change, and why; every other setting is the new config's (the
# lr schedule, the batch, the dtype, the intervals ...), the optimizer state included.
FIXED_ON_RESUME = {
    "seed": "a resumed run continues the random streams saved with it",
    "init_from": "a resumed run starts from its checkpoint",
}


def check_resumable(saved: TrainState, model: GPT, meta: dict, cfg: TrainConfig, path: Path) -> None:
    """Refuse to resume with other data, a different model shape, another optimizer, or a
    setting that a resumed run would ignore."""
    saved_optimizer = saved.config.get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(f"cannot resume: {path} was trained with optimizer = "
                          f"{saved_optimizer}, not {cfg.optimizer}; resume with --optimizer "
                          f"{saved_optimizer}, or start a new run")
    if saved.tokenizer != meta["tokenizer"]:
        raise ConfigError(f"cannot resume: {path} was trained with another tokenizer or "
                          f"vocabulary than the {meta['tokenizer']['kind']} data in data_dir; "
                          f"use the run's original data_dir")
    for key, value in saved.model_args.items():
        if getattr(model.config, key) != value:
            raise ConfigError(f"cannot resume: {key} is {getattr(model.config, key)} in the "
                              f"config but {value} in {path}; use the run's original settings")
    for key, why in FIXED_ON_RESUME.items():
        value = saved.config.get(key, getattr(cfg, key))
        if getattr(cfg, key) != value:
            raise ConfigError(f"cannot resume: {key} is {getattr(cfg, key)!r} in the config "
                              f"but {value!r} in {path}, and {why}; drop the option or start "
                              f"a new run")
