"""Commands as real processes without paying torch's import each time: a server process
imports the heavy libraries once (no torch operation runs in it, so no thread exists to be
lost in a fork), then forks a child per command, which runs the command's file or module as
`python` would, with its own argv, cwd, environment, stdout, stderr and exit status.

Usage (tests/test_cli_errors.py, whose 80 cases fail in argument checks, before any work):
    with CommandServer(cwd=REPO) as server:
        result = server.run(["train.py", "--learning-rate", "nan"], env=os.environ)
        result.returncode, result.stdout, result.stderr   # as subprocess.run(...) gives them

Run as a script, this file is the server: a JSON request a line on stdin, the exit status a
line on stdout.
"""

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOADED = ("torch", "numpy", "typer", "tqdm", "tiktoken", "safetensors",
             "torch.utils.tensorboard", "fastapi", "uvicorn")


class CommandServer:
    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.process = subprocess.Popen([sys.executable, __file__], cwd=cwd, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdout.readline().strip() == "ready"

    def __enter__(self) -> "CommandServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)

    def run(self, argv: list[str], env: dict[str, str],
            timeout: float = 120) -> subprocess.CompletedProcess:
        """argv as after `python` (a script, -m MODULE or -c CODE, then its arguments)."""
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "out", Path(folder) / "err"
            request = {"argv": argv, "cwd": str(self.cwd), "env": dict(env), "out": str(out),
                       "err": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            assert ready, f"{argv} ran past {timeout} s"
            code = int(self.process.stdout.readline())
            return subprocess.CompletedProcess([sys.executable, *argv], code,
                                               out.read_text(), err.read_text())


def child(request: dict) -> None:
    """In the forked process: become the command, run it, and exit with its status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                           (2, request["err"], os.O_WRONLY)):
        os.dup2(os.open(path, mode | (os.O_CREAT if fd else 0), 0o644), fd)
    argv, code = request["argv"], 0
    try:
        run(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str]) -> None:
    import runpy
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv, sys.path[0] = list(argv), str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


def serve() -> None:
    import importlib
    for name in PRELOADED:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    serve()
