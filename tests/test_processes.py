"""The suite's own check that no process outlives it (tests/processes.py) tells the helpers that
torch keeps until its process exits apart from the processes that a test left running."""

import subprocess
import sys

import psutil

from tests.processes import command_line, is_helper, session_processes


def test_torchs_compile_workers_are_helpers_and_a_stray_process_is_not():
    # the compiler's pool is a process of its own, which forks the workers, so that the
    # workers are this process's grandchildren
    from torch._inductor.compile_worker.subproc_pool import SubprocPool
    pool = SubprocPool(2)
    # a stray that bears a helper's name but is no descendant: its parent exits at once
    subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, "
                    "'-c', 'import time; time.sleep(60)', 'torch/_inductor/compile_worker'])"],
                   check=True)
    try:
        assert pool.submit(abs, -3).result(timeout=120) == 3  # a worker has been forked by now
        side = psutil.Process(pool.process.pid)
        workers = side.children()
        assert workers and is_helper(side) and all(is_helper(w) for w in workers)
        (stray,) = strays()
        assert not is_helper(stray)
    finally:
        for p in strays():
            p.kill()
        pool.shutdown()


def strays() -> list[psutil.Process]:
    return [p for p in session_processes()
            if command_line(p).endswith("time.sleep(60) torch/_inductor/compile_worker")]
