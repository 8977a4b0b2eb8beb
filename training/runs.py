"""The run folder (which one a run writes to, and its lock), and how a run stops cleanly
when a signal asks it to. A run never writes into another run's folder, old or live.

Usage:
    from training.runs import TrainResult, run_folder, stop_signals
    with stop_signals() as stop, run_folder(cfg, resume, dist) as run:
        run.path                      # runs/quickstart (or -2, -3 ...), locked by rank 0
        if stop.asked(dist, device, at_log_point=True): ...   # Ctrl-C, SIGTERM or SIGHUP came
        run.resume_hint()             # what is on disk to go on from, and the command
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from machine.errors import UserError
from machine.files import FolderLock, lock_folder, probe_writable
from model import GPT
from training import distributed
from training.config import ConfigError, TrainConfig

LOCK = ".lock"
SHARDED = ".dcp"  # weights/sharded.py's suffix, named here so that a plain run need not import it


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss, a failed write); the last checkpoint stays."""

    @classmethod
    def diverged(cls, problem: str, everywhere: bool | None = None) -> TrainingError:
        """The error of a run whose loss or weights became NaN or inf, with what to do."""
        return cls(f"{problem}; the last good checkpoint is kept: lower the learning rates or set a "
                   f"lower grad_clip", everywhere=everywhere)


class Interrupted(TrainingError):
    """SIGINT, SIGTERM or SIGHUP arrived; the last finished step was saved."""
    label = "interrupted"  # what train.py's one line starts with, in place of "error"
    everywhere = True  # every process saves and leaves together

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for death by signal


@dataclass
class TrainResult:
    """What train() returns; report() is what train.py prints when the run ends."""
    run_dir: Path
    iter_num: int
    best_val_loss: float
    final_losses: dict[str, float]
    wall_time: float
    checkpoint: Path | None  # last.pt, or last.dcp under FSDP; None if no checkpoint was saved
    chat: bool = False  # whether it trained on conversations, to talk to with sample.py --chat

    def report(self) -> str:
        sharded = self.checkpoint is not None and self.checkpoint.suffix == SHARDED
        ext, plain = (SHARDED, f"python export.py {self.run_dir} --plain, then ") if sharded else (".pt", "")
        return (f"done: {self.iter_num} iters in {self.wall_time:.0f}s, "
                f"best val loss {self.best_val_loss:.4f}\n"
                f"checkpoints: {self.run_dir}/best{ext}, {self.run_dir}/last{ext}\n"
                f"next: {plain}python sample.py --run {self.run_dir}"
                f"{' --chat' if self.chat else ''}   |   tensorboard --logdir {self.run_dir.parent}")


@dataclass
class Run:
    """The folder a run writes to, and the checkpoint it last wrote or resumed from."""
    path: Path
    resume_flags: str  # what the same command needs to continue this run
    checkpoint: Path | None = None  # last.pt, or last.dcp under FSDP
    saved_iter: int | None = None

    def record_checkpoint(self, checkpoint: Path, iter_num: int) -> None:
        self.checkpoint, self.saved_iter = checkpoint, iter_num

    def resume_hint(self) -> str:
        """What is on disk to go on from after a failure, and how."""
        if self.checkpoint is None:
            return "no checkpoint was written yet; free space and start again"
        return (f"{self.checkpoint} (iter {self.saved_iter}) is intact; continue with the "
                f"same command and {self.resume_flags}")

    def check_room(self, model: GPT, dist: distributed.Dist) -> None:
        """Fail now, not at the first checkpoint, unless the folder takes a file and the disk
        holds last.pt, best.pt and a temporary copy (fp32 weights and two AdamW moments)."""
        need = 3 * 3 * 4 * sum(p.numel() for p in model.parameters())
        distributed.from_main(lambda: check_writable(self.path, need), dist)


@contextmanager
def run_folder(cfg: TrainConfig, resume: bool, dist: distributed.Dist) -> Iterator[Run]:
    """runs/<run_name>, chosen by choose_run_dir and locked by rank 0 until the run ends;
    every process gets the Run. A run that fails before it writes a file removes what
    taking the folder created."""
    lock: FolderLock | None = None

    def take() -> Path:
        nonlocal lock
        lock = choose_run_dir(cfg, resume)
        return lock.path
    path = distributed.from_main(take, dist)
    given = path.name == (cfg.run_name or "run")
    run = Run(path, "--resume" if given else f"--run-name {path.name} --resume")
    before = set(path.iterdir()) if lock is not None else set()
    try:
        yield run
    except BaseException:
        if lock is not None:  # a run that wrote no file leaves the folder as it found it
            lock.release(undo=set(path.iterdir()) <= before)
        raise
    if lock is not None:
        lock.release()


def saved_nothing(run_dir: Path) -> bool:
    """Whether run_dir holds only its lock and the TensorBoard events of a run that died
    before its first checkpoint (killed, or a second Ctrl-C while it started), which are not
    worth keeping. Ask only while holding the lock, because a live run's start looks the same."""
    files = list(run_dir.iterdir())
    events = "events.out.tfevents."  # TensorBoard's files
    return bool(files) and all(f.is_file() and (f.name == LOCK or f.name.startswith(events)) for f in files)


def choose_run_dir(cfg: TrainConfig, resume: bool) -> FolderLock:
    """runs/<run_name>, its lock held. A new run never writes into another run's folder, old
    or live; it takes the next free -2, -3, ... name instead. A resumed run must find its
    last.pt there and no live run. A folder where a run saved nothing is taken over and its
    stale events deleted, so that a run killed in its first seconds does not push the next
    one to -2."""
    base = run_dir_of(cfg)
    if base.exists() and not base.is_dir():
        raise ConfigError(f"{base} is a file, not a run folder; choose another --run-name or --out-dir")
    try:
        if resume:
            check_resumable_folder(cfg)
            folder = lock_folder(base, LOCK)
            if folder is None:
                raise ConfigError(f"{base} is in use by a run that is still going; wait "
                                  f"for it to end, or start a new run without --resume")
            return folder
        for n in range(1, 10_000):
            run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
            if run_dir.exists() and not run_dir.is_dir():
                continue
            folder = lock_folder(run_dir, LOCK)
            if folder is None:
                continue  # a live run's folder
            if saved_nothing(run_dir):  # new, or left by a run that died before saving
                for f in run_dir.iterdir():
                    if f.name != LOCK:
                        f.unlink()
                return folder
            folder.release(undo=True)  # an old run's folder, left as it was
    except OSError as e:
        raise ConfigError(f"cannot write to {e.filename or base} ({e.strerror}); choose "
                          f"another --out-dir or --run-name") from None
    raise ConfigError(f"{base} and 9,999 numbered folders beside it are taken; choose another --run-name")


def run_dir_of(cfg: TrainConfig) -> Path:
    """The folder the config names: out_dir/run_name (a new run may take run_name-2 ...)."""
    return Path(cfg.out_dir) / (cfg.run_name or "run")


def check_resumable_folder(cfg: TrainConfig) -> None:
    """That the config's run folder is one --resume can continue: one with a checkpoint."""
    run_dir = run_dir_of(cfg)
    if not any((run_dir / name).exists() for name in ("last.pt", f"last{SHARDED}")):
        raise ConfigError(f"nothing to resume: {run_dir} holds no last.pt (nor last.dcp); "
                          f"drop --resume to start a new run")


def check_writable(run_dir: Path, checkpoint_bytes: int) -> None:
    """Check that the folder takes a file now and the disk has room for checkpoint_bytes."""
    try:
        probe_writable(run_dir)
    except OSError as e:
        raise ConfigError(f"cannot write to {run_dir} ({e.strerror}); choose another --out-dir") from None
    free = shutil.disk_usage(run_dir).free
    if free < checkpoint_bytes:
        raise ConfigError(f"{run_dir} has {free / 1e6:.0f} MB free but checkpoints need about "
                          f"{checkpoint_bytes / 1e6:.0f} MB; free space or choose another --out-dir")


class StopRequest:
    """The signal that asked the run to save and leave, if one came."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def asked(self, dist: distributed.Dist, device: torch.device, at_log_point: bool) -> bool:
        """Whether a signal asked this run to stop. Under torchrun the processes agree at log
        points alone, where the loop waits for the device anyway, on the highest signal any got."""
        if dist.enabled and at_log_point:
            self.signal = distributed.largest(self.signal or 0, dist, device) or None
        return self.signal is not None and (at_log_point or not dist.enabled)


@contextmanager
def stop_signals() -> Iterator[StopRequest]:
    """While active, SIGINT, SIGTERM and SIGHUP (the terminal or SSH session closed) only
    set stop.signal, so the loop can finish its step and save. A second Ctrl-C interrupts
    at once, as usual, and leaves as Interrupted, which the command reports in one line."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        stop.signal = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {s: signal.signal(s, handler)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield stop
    except KeyboardInterrupt:
        raise Interrupted("stopped at once by a second Ctrl-C; the last checkpoint, if any, "
                          "is intact", signal.SIGINT) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
