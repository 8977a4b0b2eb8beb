"""At the end of a test session, finds the processes it started, because a process left
running (a worker whose parent was killed, a server never stopped) would outlive the suite.

Usage:
    mark_session()                          # before the first process starts
    left = left_behind(within=15)           # at the end: command lines still running
    still_running(processes, within=30)     # those of `processes` that do not end in time

A process belongs to the session when its environment holds MARK with this session's value.
Every process the tests start inherits it, and so do the processes those start, even after
another process adopts them because their parent died.
"""

import os
import time
from contextlib import suppress

import psutil

MARK = "GPTLAB_TEST_SESSION"
# Helpers that this process's libraries keep running until it exits, and that end with it:
# multiprocessing's resource tracker and forkserver, and torch's compile workers.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
           "torch._inductor.compile_worker", "torch/_inductor/compile_worker")


def mark_session() -> None:
    os.environ[MARK] = f"{os.getpid()}-{time.time_ns()}"


def still_running(processes: list[psutil.Process], within: float) -> list[str]:
    """The command lines of the `processes` still running after `within` seconds; returns
    early once none is. A zombie counts as ended, because only its exit status is left to
    read."""
    deadline = time.monotonic() + within
    while True:
        running = [p for p in processes if is_running(p)]
        if not running or time.monotonic() > deadline:
            return [command_line(p) for p in running]
        time.sleep(0.1)


def left_behind(within: float) -> list[str]:
    """The command lines of the session's processes still running after `within` seconds,
    apart from this process and its libraries' helpers. Each one is then killed, so the suite
    leaves nothing behind whatever it reports."""
    processes = [p for p in session_processes() if not is_helper(p)]
    left = still_running(processes, within)
    for p in processes:
        with suppress(psutil.NoSuchProcess):
            p.kill()
    return left


def session_processes() -> list[psutil.Process]:
    mark, found = os.environ.get(MARK), []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(MARK) == mark:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # it has ended, or it belongs to another user, so it is not ours
    return found


def is_helper(p: psutil.Process) -> bool:
    """Whether `p` is a helper that this process's libraries keep until this process exits. It
    may be a child's child, because torch's compile workers are forked by a pool process of their own."""
    try:
        return (any(h in command_line(p) for h in HELPERS)
                and os.getpid() in [parent.pid for parent in p.parents()[:2]])
    except psutil.NoSuchProcess:
        return True


def is_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def command_line(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"process {p.pid}"
