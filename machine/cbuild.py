"""C files of this project, compiled on the machine that runs them and kept in the cache.

Usage:
    from machine.cbuild import BuildError, build_library
    lib = build_library(Path("cdecode/decode_step.c"), ["-DWEIGHT_BF16"], "the C decode step",
                        instead="choose --decode eager", exports=("decode_step",))

The C compiler (`cc`, or $CC) builds a file once for this CPU (-march=native), with
$GPTLAB_CFLAGS after its own flags, and with OpenMP where it can, into $GPTLAB_CACHE/<the
file's stem>/ (machine/files.cache_dir), with its sha256 beside it, so a damaged copy is
built again. A build that had to leave out -march or OpenMP says so on stderr each time it
is loaded. A new build is loaded and checked for the symbols its caller needs before it is
cached, so a compiler or flags that make something else (GPTLAB_CFLAGS=-E, CC=true) are one
line naming them (CompilerError), and nothing is cached. PyTorch ships its own OpenMP
runtime under the same name as the system's, so a library built here shares PyTorch's
threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

from machine.device import cpu_flags
from machine.errors import UserError
from machine.files import cache_dir, cache_unusable, write_bytes_atomic

# Part of every build's key. It is raised whenever the cache's files change meaning, so that
# a build cached under an older format is built again rather than misread.
FORMAT = "build 2"


class BuildError(UserError):
    """A C file cannot be built or loaded on this machine (no compiler, a cache folder that
    cannot be used); the message says what to do, and a caller may fall back to code that
    needs no C."""


class CompilerError(UserError):
    """The compiler or the flags given to it (CC, GPTLAB_CFLAGS) made something other than
    the library: nothing, a file that does not load, or a library without what it must
    export. No caller falls back from this, because the same settings would build the same
    wrong thing on every run, and a fallback would hide them."""


def compiler(what: str, instead: str) -> str:
    """$CC, else the first of cc, gcc and clang on the PATH. $CC may hold a command with its
    own arguments, as make reads it (CC="ccache gcc"), split as a shell would."""
    found = [c for c in ("cc", "gcc", "clang") if shutil.which(c)]
    name = os.environ.get("CC") or (found[0] if found else "cc")
    try:
        program = (shlex.split(name) or [""])[0]
    except ValueError as e:  # a quote left open
        raise CompilerError(f"CC ({name}) cannot be split as a shell would ({e}); close its "
                            f"quotes") from None
    if shutil.which(program) is None:
        raise BuildError(f"{what} needs a C compiler, and {name!r} was not found; install gcc "
                         f"or clang (or set CC), or {instead}")
    return name


def build_library(source: Path, defines: list[str], what: str, instead: str,
                  march: str = "native", exports: tuple[str, ...] = (),
                  check: Callable[[ctypes.CDLL], str | None] | None = None) -> ctypes.CDLL:
    """Compile `source` with `defines` (or reuse the cached build) and load it.

    what: the library in words, for messages ("the C decode step"); instead: what a user
    without a compiler can do. march: the instruction set to build for, as gcc's -march
    names it; "native" is this CPU. exports: the symbols the library must have; check: what
    else is wrong with a loaded library, in words that follow "built <what>" ("for bfloat16
    weights, not float32"), or None. A cached build that fails either is built again; a new
    build that fails either is a CompilerError, and is not cached.
    """
    cc = compiler(what, instead)
    base = ["-O3", "-shared", "-fPIC", *defines]
    # the library is built on the machine that runs it, so it may use all of this CPU,
    # and full-width AVX-512 in the loops left to the compiler
    arch = [f"-march={march}"]
    if platform.machine() == "x86_64":
        arch.append("-mprefer-vector-width=512")
    # threads need OpenMP; a compiler without it (Apple's clang) builds a one-thread library
    attempts = {"": [*base, *arch, "-fopenmp"],
                f"without -march={march}": [*base, "-fopenmp"],
                f"without -march={march} or OpenMP (one thread)": base}
    # a user's flags come last, so that a -march among them wins over this CPU's
    # (GPTLAB_CFLAGS=-march=x86-64-v3 builds for an AVX2 CPU, on one with AVX-512)
    try:
        extra = shlex.split(os.environ.get("GPTLAB_CFLAGS", ""))
    except ValueError as e:  # a quote left open
        raise CompilerError(f"GPTLAB_CFLAGS ({os.environ['GPTLAB_CFLAGS']}) cannot be split into "
                            f"flags as a shell would ({e}); close its quotes") from None
    attempts = {without: [*flags, *extra] for without, flags in attempts.items()}
    # the key includes the CPU's architecture and flags, because -march=native builds for
    # this one and a cache folder may be shared between machines
    cpu = f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"
    key = hashlib.sha256(" ".join([FORMAT, cc, *attempts[""], cpu]).encode()
                         + source.read_bytes()).hexdigest()[:16]
    try:
        out = cache_dir() / source.stem / f"{key}.so"
    except UserError as e:  # a user without a home, whose fallback folder is not private
        raise BuildError(str(e)) from None
    try:
        lacks = read_build(out, attempts)
        lib = None if lacks is None else load(out, exports, check)
        if lib is None:
            if sys.stderr.isatty():  # compiling takes a moment, so tell a watcher
                print(f"building {what} with {cc} (once: it is kept in {out.parent})",
                      file=sys.stderr, flush=True)
            lib, lacks = compile_library(cc, source, attempts, out, what, exports, check)
    except OSError as e:  # GPTLAB_CACHE names a file, a folder this user cannot write, ...
        raise BuildError(cache_unusable(e)) from None
    if lacks:
        print(f"note: {cc} built {what} {lacks}, so it runs slower than it could",
              file=sys.stderr)
    return lib


def compile_library(cc: str, source: Path, attempts: dict[str, list[str]], out: Path,
                    what: str, exports: tuple[str, ...],
                    check: Callable[[ctypes.CDLL], str | None] | None) -> tuple[ctypes.CDLL, str]:
    """Build `source` with the first flags in `attempts` that work, check that the result
    loads and has what it must, and only then cache it in `out`, beside its digest and a
    note of what the build lacks. Returns the library, loaded from where it was built, and
    what it lacks ("" for nothing)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    given = os.environ.get("GPTLAB_CFLAGS")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        lacks = None
        for without, flags in attempts.items():
            result = subprocess.run([*shlex.split(cc), *flags, str(source), "-o", str(tmp_out),
                                     "-lm"],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                lacks = without
                break
            if "File too large" in result.stderr or "No space left" in result.stderr:
                # the disk failed, not the flags, and a fallback build would be cached for good
                raise BuildError(f"{cc} could not write {what} in {out.parent} (the disk is "
                                 f"full or a file size limit is set); free space")
        if lacks is None:
            last_line = (result.stderr.strip().splitlines() or ["no message"])[-1]
            # a user's own flags that fail are theirs to fix; without them, this machine's
            # compiler cannot build the file, and a caller may do without it
            error = CompilerError if given else BuildError
            raise error(f"{cc} could not build {source.name}: {last_line}"
                        + (f"; check GPTLAB_CFLAGS ({given})" if given else ""))
        lib = verified(tmp_out, cc, what, exports, check)
        # The note and the library are written before the digest, which covers both, so
        # that a process stopped between the writes leaves a build that reads as absent.
        note = out.with_suffix(".note")
        if lacks:
            write_bytes_atomic(note, lacks.encode())
        else:
            note.unlink(missing_ok=True)
        # written whole or not at all, so that another process never loads half a library
        library = tmp_out.read_bytes()
        write_bytes_atomic(out, library)
        write_bytes_atomic(out.with_suffix(".sha256"), digest(library, lacks).encode())
    # the library stays mapped after its temporary folder is removed
    return lib, lacks


# what the process that tries a new library runs: exit status 3 and dlopen's words for a file
# that does not load
LOAD_PROBE = ("import ctypes, sys\ntry:\n    ctypes.CDLL(sys.argv[1])\nexcept OSError as e:\n"
              "    sys.exit(print(e, file=sys.stderr) or 3)")


def verified(library: Path, cc: str, what: str, exports: tuple[str, ...],
             check: Callable[[ctypes.CDLL], str | None] | None) -> ctypes.CDLL:
    """The library a compiler that exited 0 wrote, loaded; CompilerError, naming the settings
    to check, for nothing written, a file that does not load, or a library that lacks what
    it must have (GPTLAB_CFLAGS=-E writes preprocessed text, --version or CC=true nothing)."""
    given, chosen = os.environ.get("GPTLAB_CFLAGS"), os.environ.get("CC")
    named = [f"GPTLAB_CFLAGS ({given})"] if given else []
    named += [f"CC ({chosen})"] if chosen else []
    fix = f"; check {' and '.join(named) or f'the compiler {cc}'}"
    if not library.is_file():
        raise CompilerError(f"{cc} exited without an error but wrote no library for {what}{fix}")
    # Loaded first in a process of its own, because some libraries end the process that loads
    # them (an ASan build's runtime exits when it is not loaded first).
    probe = subprocess.run([sys.executable, "-S", "-c", LOAD_PROBE, str(library)],
                           capture_output=True, text=True)
    said = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
    if probe.returncode == 3 and library.read_bytes()[:4] == b"\x7fELF" and "failed to map" in said:
        raise OSError(said)  # a library the folder will not map (mounted noexec): the cache's fault
    if probe.returncode != 0:
        why = said.rsplit(": ", 1)[-1] if probe.returncode == 3 else f"loading it ended Python: {said}"
        raise CompilerError(f"{cc} exited without an error but wrote no library that loads "
                            f"for {what} ({why}){fix}")
    lib = ctypes.CDLL(str(library))
    problem = missing(lib, exports, check)
    if problem:
        raise CompilerError(f"{cc} built {what} {problem}{fix}")
    return lib


def load(library: Path, exports: tuple[str, ...],
         check: Callable[[ctypes.CDLL], str | None] | None) -> ctypes.CDLL | None:
    """A cached library, loaded, or None where it does not load or lacks what it must have,
    so that it is built again (an older build, or one that another version of this file
    cached with a valid digest)."""
    try:
        lib = ctypes.CDLL(str(library))
    except OSError:
        return None
    return None if missing(lib, exports, check) else lib


def missing(lib: ctypes.CDLL, exports: tuple[str, ...],
            check: Callable[[ctypes.CDLL], str | None] | None) -> str | None:
    """What a loaded library lacks, in words that follow "built <what>", or None."""
    absent = [name for name in exports if not hasattr(lib, name)]
    if absent:
        return f"without {', '.join(absent)}"
    return check(lib) if check else None


def digest(library: bytes, lacks: str) -> str:
    """The sha256 of a build: the library's bytes and its note's, so that neither can change
    alone. A build that lacks nothing has the digest of its library alone."""
    return hashlib.sha256(library + lacks.encode()).hexdigest()


def read_build(library: Path, reasons: Collection[str]) -> str | None:
    """What a cached build lacks ("" for nothing, else one of `reasons`), or None where the
    build is absent or cannot be trusted: the library or its digest missing, a file that
    cannot be read or is not UTF-8 text where text belongs, a note that names no known
    reason, or a digest that does not match. This is the one reader of a build's files, so
    that any damage reads as "build it again" rather than as an error, and a library damaged
    in the cache (a copy cut short), which can crash the process that loads it (SIGBUS),
    is never loaded."""
    try:
        data = library.read_bytes()
        recorded = library.with_suffix(".sha256").read_bytes().decode("utf-8")
        try:
            lacks = library.with_suffix(".note").read_bytes().decode("utf-8")
        except FileNotFoundError:
            lacks = ""
    except (OSError, UnicodeDecodeError):
        return None
    if (lacks and lacks not in reasons) or digest(data, lacks) != recorded.strip():
        return None
    return lacks
