"""Signals as a terminal sends them, for tests that interrupt a real command."""

import signal


def as_from_a_terminal() -> None:
    """A preexec_fn that makes Ctrl-C reach the command as it does from a shell's prompt,
    whatever the test process inherited. A test worker may run with SIGINT ignored or
    blocked, and a child inherits both."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
