"""How many CPU threads a loop computes with, chosen from the time of its own steps.

Usage:
    from machine.threads import fit_threads, usable_cpus
    with fit_threads(0, device, print) as threads:   # 0 measures; N > 0 fixes N threads
        for batch in batches:
            threads.step()                            # once per step, at the same place
    usable_cpus()                                     # (2, "2 CPUs")

PyTorch splits each CPU operation among its threads, and an operation ends when its slowest
thread does, so when another process takes one of those cores, a step of small operations can
run slower on two threads than on one. The step's own time tells which count is fastest: at
the start each count is timed, from the most threads down while fewer are faster; later the
count in use is timed against one more and one fewer, when the step's time moves by a quarter
and otherwise at intervals that double, never sooner than the trials' cost allows (BUDGET). A
count that was given, or OMP_NUM_THREADS, is obeyed (docs/performance.md#threads-and-a-busy-machine).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def usable_cpus() -> tuple[int, str]:
    """How many CPUs this process may run on, and why: the CPUs its affinity allows
    (taskset, a batch scheduler), capped by a container's CPU quota (cgroup v2's cpu.max,
    "QUOTA PERIOD" in the process's group or one above it)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        count = os.cpu_count() or 1
    quota = math.inf  # in CPUs' worth of time
    try:  # /proc/self/cgroup is "0::/PATH" under cgroup v2
        group = Path("/sys/fs/cgroup", Path("/proc/self/cgroup").read_text().split("::")[1].strip()[1:])
        for folder in (group, *group.parents):
            limit = folder / "cpu.max"  # "max 100000", or "150000 100000" for 1.5 CPUs
            words = limit.read_text().split() if limit.is_file() else ["max"]
            if words[0] != "max":
                quota = min(quota, int(words[0]) / int(words[1]))
    except (OSError, IndexError, ValueError):  # no cgroup v2 here, or nothing readable
        pass
    if quota < count - 1:  # a quota of 1.5 CPUs keeps 2 threads busy
        return max(1, math.ceil(quota)), f"a CPU quota of {quota:g} of {count} CPUs"
    return count, f"{count} CPU{'s' * (count > 1)}"


def thread_counts(top: int) -> list[int]:
    """The counts worth timing, most first: all, one fewer (a core left to a neighbour),
    then halves down to one, e.g. 16, 15, 8, 4, 2, 1."""
    counts, half = {top, max(1, top - 1)}, top
    while half > 1:
        half //= 2
        counts.add(half)
    return sorted(counts, reverse=True)


class ThreadFit:
    """Times a loop's steps and keeps torch's thread count at the fastest one measured. Each
    step() ends the step that the previous call began. A count's time is the median of TRIAL
    steps, so that one slow step (an evaluation, a checkpoint) moves it little."""

    START = 2  # steps left out at the start, which are slow for reasons of their own
    TRIAL = 3  # steps timed at each count
    KEEP = 1.05  # another count must be this much faster to replace the one in use
    GIVE_UP = 1.3  # a count whose first step is this much slower than the best is dropped
    CHANGE = 1.25  # a change in the step's time, either way, that calls for a new trial
    FIRST_RECHECK, LAST_RECHECK = 25, 1600  # steps between trials, doubling while unchanged
    # a trial waits until the loop has stepped for BUDGET times the last trial's cost, so that
    # trials take at most about a twentieth of the loop's time, however often its step moves
    BUDGET = 20

    def __init__(self, counts: list[int], say: Callable[[str], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.counts, self.say, self.clock = counts, say, clock
        self.count = self.before = torch.get_num_threads()
        self.trial: list[int] = []  # the counts still to time in the trial under way
        self.timed: dict[int, float] = {}  # seconds a step at each count timed in it
        self.samples: list[float] = []  # the current count's step times in it
        self.skip, self.first, self.reference = 0, True, math.nan
        self.recent: deque[float] = deque(maxlen=5)  # the last steps, to see the time move
        self.interval = self.until_trial = self.START
        self.last: float | None = None
        self.stepped = 0.0  # seconds of steps so far
        self.trial_time, self.trial_steps = 0.0, 0  # the trial under way's steps
        self.next_trial_at = 0.0  # the value of `stepped` before which no trial starts

    def step(self, seconds: float | None = None) -> None:
        """End a step: one that began at the previous call, or that took `seconds` (for a
        loop that waits between its steps, as a server does)."""
        now = self.clock()
        if seconds is None:
            seconds = None if self.last is None else now - self.last
        self.last = now
        if seconds is None or len(self.counts) < 2:
            return
        self.stepped += seconds
        if self.trial:
            self.trial_time, self.trial_steps = self.trial_time + seconds, self.trial_steps + 1
            self.time_trial(seconds)
            return
        self.recent.append(seconds)
        self.until_trial -= 1
        moved = (len(self.recent) == self.recent.maxlen and not 1 / self.CHANGE
                 < statistics.median(self.recent) / self.reference < self.CHANGE)
        if (moved or self.until_trial <= 0) and self.stepped >= self.next_trial_at:
            if moved:
                self.interval = self.FIRST_RECHECK
            self.trial, self.timed, self.before = self.counts_to_try(), {}, self.count
            self.use(self.trial[0])

    def counts_to_try(self) -> list[int]:
        """At the start, every count from the one in use down; later, the one in use, then
        the next count above it and the next below it, where there are such counts."""
        if self.first:
            return [c for c in self.counts if c <= self.count]
        i = self.counts.index(self.count)  # the counts run from most to fewest threads
        return [self.count, *self.counts[max(0, i - 1):i], *self.counts[i + 1:i + 2]]

    def time_trial(self, seconds: float) -> None:
        if self.skip:
            self.skip -= 1
            return
        self.samples.append(seconds)
        # a count far slower at its first step is dropped at once, so that a trial on a
        # quiet machine costs about one slow step
        hopeless = bool(self.timed) and seconds > min(self.timed.values()) * self.GIVE_UP
        if len(self.samples) < self.TRIAL and not hopeless:
            return
        count = self.trial.pop(0)
        self.timed[count], self.samples = statistics.median(self.samples), []
        if self.first and self.timed[count] > min(self.timed.values()) * self.KEEP:
            self.trial = []  # the first trial goes down only while fewer threads are faster
        if self.trial:
            self.use(self.trial[0])
            return
        fastest = min(self.timed, key=self.timed.__getitem__)
        kept = self.timed[self.before] <= self.timed[fastest] * self.KEEP
        chosen = self.before if kept else fastest
        times = ", ".join(f"{c}: {self.timed[c] * 1e3:.0f} ms" for c in sorted(self.timed, reverse=True))
        if self.first:
            self.say(f"threads {chosen}, the fastest step measured ({times})")
        elif not kept:
            self.say(f"threads {self.before} -> {chosen}, the fastest step now ({times}); "
                     f"another process may have started or stopped")
        self.use(chosen)
        self.interval = (min(2 * self.interval, self.LAST_RECHECK) if kept and not self.first
                         else self.FIRST_RECHECK)
        self.until_trial, self.reference, self.first = self.interval, self.timed[chosen], False
        self.recent.clear()
        # what the trial cost: its steps' time beyond what the chosen count would have taken
        cost = max(0.0, self.trial_time - self.trial_steps * self.timed[chosen])
        self.next_trial_at = self.stepped + self.BUDGET * cost
        self.trial_time, self.trial_steps = 0.0, 0

    def use(self, count: int) -> None:
        self.skip = int(count > self.count)  # a step left out while new threads start
        torch.set_num_threads(count)
        self.count = count


@contextmanager
def fit_threads(setting: int, device: torch.device,
                say: Callable[[str], None] = print) -> Iterator[ThreadFit]:
    """Choose torch's CPU thread count for a loop on `device`, say what was chosen and why,
    and restore the count found on exit. setting is a count to use (N > 0), or 0 to measure,
    unless OMP_NUM_THREADS is set. A GPU's feeding threads are left alone, silently."""
    found = torch.get_num_threads()
    cpus, why = usable_cpus()
    counts = [found]
    if setting > 0:
        counts = [setting]
        say(f"threads {setting} (as configured; {why})")
    elif os.environ.get("OMP_NUM_THREADS"):
        say(f"threads {found} (OMP_NUM_THREADS; {why})")
    elif device.type == "cpu":
        counts = thread_counts(min(found, cpus))  # torch's default is one per physical core
        say(f"threads up to {counts[0]} ({why}), timed over the first steps and again when "
            f"the step's time changes; --threads N fixes the count" if len(counts) > 1 else
            f"threads 1 ({why})")
    torch.set_num_threads(counts[0])
    try:
        yield ThreadFit(counts, say)
    finally:
        torch.set_num_threads(found)
