"""The suite's own check that no process outlives it (tests/processes.py) tells the helpers
that torch keeps until its process exits from the processes a test left running."""

import subprocess
import sys

from tests.processes import command_line, is_helper, session_processes


def test_torchs_compile_workers_are_helpers_and_a_stray_process_is_not():
    # the compiler's pool: a process of its own that forks the workers, so that on a machine
    # with many cores the workers are this process's grandchildren
    from torch._inductor.compile_worker.subproc_pool import SubprocPool
    pool = SubprocPool(2)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pool.submit(abs, -3).result(timeout=120) == 3  # a worker has been forked by now
        workers = [p for p in session_processes() if "compile_worker" in command_line(p)]
        assert len({p.ppid() for p in workers}) == 2  # the pool's process, and its workers'
        assert all(is_helper(p) for p in workers)
        assert not is_helper(next(p for p in session_processes() if p.pid == stray.pid))
    finally:
        stray.kill()
        stray.wait()
        pool.shutdown()
