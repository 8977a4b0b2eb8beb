"""The CPU thread count: a given count is obeyed and said in a run's first lines, and a
measured one follows the step's time, on a clock that the test advances by the count in use
(so that no figure here depends on the machine's speed)."""

import os

import pytest
import torch

from machine.threads import ThreadFit, fit_threads, thread_counts, usable_cpus
from tests.forked import python

CPU = torch.device("cpu")


@pytest.fixture
def threads_restored():
    found = torch.get_num_threads()
    yield
    torch.set_num_threads(found)


def run_steps(fit: ThreadFit, clock: list[float], step_seconds: dict[int, float], n: int) -> list[int]:
    """Call fit.step() n times, each step lasting step_seconds[the count in use]; return the
    count used at each step."""
    used = []
    for _ in range(n):
        fit.step()
        used.append(torch.get_num_threads())
        clock[0] += step_seconds[used[-1]]
    return used


def test_the_counts_timed_go_from_all_cores_down_to_one():
    assert thread_counts(16) == [16, 15, 8, 4, 2, 1]
    assert thread_counts(12) == [12, 11, 6, 3, 1]
    assert thread_counts(2) == [2, 1]
    assert thread_counts(1) == [1]


def test_usable_cpus_are_those_the_affinity_allows():
    count, why = usable_cpus()
    assert 1 <= count <= len(os.sched_getaffinity(0))
    assert "CPU" in why


def test_a_busy_machine_moves_to_fewer_threads_and_back_when_it_is_quiet(threads_restored):
    torch.set_num_threads(2)
    said, clock = [], [0.0]
    fit = ThreadFit([2, 1], said.append, clock=lambda: clock[0])
    busy, quiet = {2: 0.030, 1: 0.020}, {2: 0.010, 1: 0.016}
    used = run_steps(fit, clock, busy, 300)
    assert said[0] == "threads 1, the fastest step measured (2: 30 ms, 1: 20 ms)"
    assert used[-200:].count(1) >= 195  # a trial of two threads gives up after one slow step
    used = run_steps(fit, clock, quiet, 300)
    assert said[1].startswith("threads 1 -> 2, the fastest step now (2: 10 ms, 1: 16 ms)")
    assert used[-100:].count(2) >= 95
    used = run_steps(fit, clock, busy, 300)
    assert said[2].startswith("threads 2 -> 1")
    assert used[-200:].count(1) >= 195


def test_a_quiet_machine_keeps_every_thread_and_rarely_tries_fewer(threads_restored):
    torch.set_num_threads(2)
    said, clock = [], [0.0]
    fit = ThreadFit([2, 1], said.append, clock=lambda: clock[0])
    used = run_steps(fit, clock, {2: 0.010, 1: 0.016}, 1000)
    assert said == ["threads 2, the fastest step measured (2: 10 ms, 1: 16 ms)"]
    assert used.count(1) <= 10  # each trial of one thread gives up after one slow step


def test_trials_take_at_most_about_a_twentieth_of_the_time_however_the_step_moves(threads_restored):
    # a decoding loop beside a busy process: two threads take ten times one thread's step, and
    # one thread's step moves by half every ten steps, which alone would call for a trial each time
    torch.set_num_threads(2)
    said, clock = [], [0.0]
    fit = ThreadFit([2, 1], said.append, clock=lambda: clock[0])
    spent = {2: 0.0, 1: 0.0}
    for i in range(3000):
        fit.step()
        count = torch.get_num_threads()
        seconds = 0.040 if count == 2 else (0.004 if i // 10 % 2 else 0.006)
        if i >= 100:  # after the first trial
            spent[count] += seconds
        clock[0] += seconds
    assert said[0] == "threads 1, the fastest step measured (2: 40 ms, 1: 6 ms)"
    assert spent[2] <= 0.06 * (spent[1] + spent[2])


def test_many_cores_stop_at_the_fastest_count(threads_restored):
    torch.set_num_threads(16)
    said, clock = [], [0.0]
    fit = ThreadFit(thread_counts(16), said.append, clock=lambda: clock[0])
    seconds = {16: 0.040, 15: 0.030, 8: 0.020, 4: 0.025, 2: 0.05, 1: 0.09}
    used = run_steps(fit, clock, seconds, 200)
    assert said[0] == "threads 8, the fastest step measured (16: 40 ms, 15: 30 ms, 8: 20 ms, 4: 25 ms)"
    assert 2 not in used and 1 not in used  # the way down stopped once 4 was slower
    assert used[-100:].count(8) >= 90


def test_a_given_count_is_obeyed_and_restored(threads_restored):
    torch.set_num_threads(2)
    said = []
    with fit_threads(1, CPU, said.append) as fit:
        assert torch.get_num_threads() == 1
        for _ in range(50):
            fit.step()
        assert torch.get_num_threads() == 1
    assert said[0].startswith("threads 1 (as configured")
    assert torch.get_num_threads() == 2


def test_omp_num_threads_is_obeyed(monkeypatch, threads_restored):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    said = []
    with fit_threads(0, CPU, said.append) as fit:
        assert fit.counts == [1]
    assert said[0].startswith("threads 1 (OMP_NUM_THREADS")


@pytest.mark.parametrize(("args", "env", "line"), [
    (["--threads", "1"], {}, "threads 1 (as configured"),
    ([], {"OMP_NUM_THREADS": "1"}, "threads 1 (OMP_NUM_THREADS"),
])
def test_a_run_says_its_thread_count_in_its_first_lines(tiny_config, tmp_path, args, env, line):
    out = tmp_path / "runs"
    result = python(["train.py", "config/tiny.toml", "--data-dir", tiny_config.data_dir,
                     "--out-dir", str(out), "--max-iters", "2", "--eval-interval", "2", *args],
                    env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    first_iter = next(i for i, text in enumerate(lines) if text.startswith("iter "))
    assert any(text.startswith(line) for text in lines[:first_iter]), lines[:first_iter]


def test_a_thread_count_out_of_range_is_one_line(tiny_config, tmp_path):
    result = python(["train.py", "config/tiny.toml", "--data-dir", tiny_config.data_dir,
                     "--out-dir", str(tmp_path), "--threads", "-1"])
    assert result.returncode != 0
    assert "threads must be 0 (measure) or a count up to 1024, got -1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
