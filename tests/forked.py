"""Runs commands as real processes without paying for torch's import each time. A server
process imports the heavy libraries once, then forks a child per command, which runs the
command's file or module as `python` would, with its own argv, cwd, environment, stdin,
stdout, stderr and exit status. No torch operation runs in the server, so it has no threads
for a fork to lose. The child imports our own modules fresh, as a new interpreter does.
Settings that an interpreter reads only as it starts (PYTHONUNBUFFERED, PYTHONFAULTHANDLER,
malloc's and OpenMP's variables) come from the server, so a test that needs its own starts
a `python`.

Usage, for commands that run to their end (a test that signals a command, limits its
resources or gives it bytes that are not UTF-8 starts a `python` of its own):
    result = python(["train.py", "--learning-rate", "nan"], env={**os.environ, "COLUMNS": "200"})
    result.returncode, result.stdout, result.stderr   # as subprocess.run(..., text=True)

Each process of the test session (each xdist worker) starts one server, on its first command.
Run as a script, this file is the server: it reads one JSON request per line on stdin and
writes the child's pid, then its exit status, each on its own line of stdout.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOADED = ("torch", "numpy", "typer", "tqdm", "tiktoken", "safetensors",
             "torch.utils.tensorboard", "fastapi", "uvicorn")
REPO = Path(__file__).resolve().parent.parent


class CommandServer:
    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, __file__], cwd=REPO, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.reply(timeout=120) == "ready"

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
            input: str | None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            files = {name: Path(folder) / name for name in ("in", "out", "err")}
            files["in"].write_text(input or "")
            request = {"argv": argv, "cwd": str(cwd), "env": dict(env),
                       **{name: str(path) for name, path in files.items()}}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = int(self.reply(timeout=30))
            code = self.reply(timeout)
            if code is None:  # kill it and raise, as subprocess.run does
                os.kill(pid, signal.SIGKILL)
                self.reply(timeout=30)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
            return subprocess.CompletedProcess([sys.executable, *argv], int(code),
                                               files["out"].read_text(), files["err"].read_text())

    def reply(self, timeout: float) -> str | None:
        """The server's next line, or None if none came in time. It is read a byte at a time
        from the pipe itself, because a buffered reader could hold the next line where select
        cannot see it."""
        fd, line = self.process.stdout.fileno(), b""
        deadline = time.monotonic() + timeout
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            byte = os.read(fd, 1)
            assert byte, "the command server has gone"
            line += byte
        return line.decode().strip()


_server: CommandServer | None = None


def python(argv: list[str], cwd: Path = REPO, env: dict[str, str] | None = None,
           timeout: float = 300, input: str | None = None) -> subprocess.CompletedProcess:
    """`python *argv` (a script, -m MODULE or -c CODE, then its arguments) run to its end, as
    subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...) runs it."""
    global _server
    if _server is None:
        _server = CommandServer()
        atexit.register(stop_server)
    return _server.run(argv, cwd, dict(os.environ if env is None else env), timeout, input)


def stop_server() -> None:
    """End this process's command server, if it has one; the next command starts another."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def child(request: dict) -> None:
    """In the forked process, become the command, run it, run the exit handlers that an
    interpreter runs as it ends, and exit with the command's status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in ((0, request["in"], os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                           (2, request["err"], os.O_WRONLY)):
        os.dup2(os.open(path, mode | (os.O_CREAT if fd else 0), 0o644), fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
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
    atexit._run_exitfuncs()
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
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            # a library this Python lacks (fastapi on the GPU machines) is reported by the
            # command that needs it, and the other commands still run
            pass
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    serve()
