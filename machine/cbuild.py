"""C files of this project, compiled on the machine that runs them and kept in the cache.

Usage:
    from machine.cbuild import BuildError, build_library
    lib = build_library(Path("cdecode/decode_step.c"), ["-DWEIGHT_BF16"], "the C decode step",
                        instead="choose --decode eager")

The C compiler (`cc`, or $CC) builds a file once for this CPU (-march=native), with
$GPTLAB_CFLAGS after its own flags, and with OpenMP where it can, into $GPTLAB_CACHE/<the
file's stem>/ (default ~/.cache/gptlab), with its sha256 beside it, so a damaged copy is
built again. A build that had to leave out -march or OpenMP says so on stderr each time it
is loaded. PyTorch ships its own OpenMP runtime under the same name as the system's, so a
library built here shares PyTorch's threads.
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
from pathlib import Path

from machine.device import cpu_flags
from machine.errors import UserError
from machine.files import cache_dir, cache_unusable, write_bytes_atomic


class BuildError(UserError):
    """A C file cannot be built or loaded here; the message says what to do."""


def compiler(what: str, instead: str) -> str:
    """$CC, else the first of cc, gcc and clang on the PATH."""
    found = [c for c in ("cc", "gcc", "clang") if shutil.which(c)]
    name = os.environ.get("CC") or (found[0] if found else "cc")
    if shutil.which(name) is None:
        raise BuildError(f"{what} needs a C compiler, and {name!r} was not found; install gcc "
                         f"or clang (or set CC), or {instead}")
    return name


def build_library(source: Path, defines: list[str], what: str, instead: str,
                  march: str = "native") -> ctypes.CDLL:
    """Compile `source` with `defines` (or reuse the cached build) and load it.

    what: the library in words, for messages ("the C decode step"); instead: what a user
    without a compiler can do. march: the instruction set to build for, as gcc's -march
    names it; "native" is this CPU.
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
    extra = shlex.split(os.environ.get("GPTLAB_CFLAGS", ""))
    attempts = {without: [*flags, *extra] for without, flags in attempts.items()}
    # the key includes the CPU's architecture and flags, because -march=native builds for
    # this one and a cache folder may be shared between machines
    cpu = f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"
    key = hashlib.sha256(" ".join([cc, *attempts[""], cpu]).encode()
                         + source.read_bytes()).hexdigest()[:16]
    out = cache_dir() / source.stem / f"{key}.so"
    note = out.with_suffix(".note")  # what a fallback build lacks, kept beside it
    try:
        # a library damaged in the cache (a copy cut short) can crash the process that
        # loads it (SIGBUS), so it is checked against the digest written when it was built
        if not intact(out):
            if sys.stderr.isatty():  # compiling takes a moment, so tell a watcher
                print(f"building {what} with {cc} (once: it is kept in {out.parent})",
                      file=sys.stderr, flush=True)
            compile_library(cc, source, attempts, out, note, what)
        lib = ctypes.CDLL(str(out))
    except OSError as e:  # GPTLAB_CACHE names a file, a folder this user cannot write, ...
        raise BuildError(cache_unusable(e)) from None
    if note.exists():
        print(f"note: {cc} built {what} {note.read_text()}, so it runs slower than it could",
              file=sys.stderr)
    return lib


def compile_library(cc: str, source: Path, attempts: dict[str, list[str]], out: Path,
                    note: Path, what: str) -> None:
    """Build `source` into `out` with the first flags in `attempts` that work, and say in
    `note` what that build lacks, if anything."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        lacks = None
        for without, flags in attempts.items():
            result = subprocess.run([cc, *flags, str(source), "-o", str(tmp_out), "-lm"],
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
            given = os.environ.get("GPTLAB_CFLAGS")
            raise BuildError(f"{cc} could not build {source.name}: {last_line}"
                             + (f"; check GPTLAB_CFLAGS ({given})" if given else ""))
        if lacks:
            write_bytes_atomic(note, lacks.encode())
        # written whole or not at all, so that another process never loads half a library
        library = tmp_out.read_bytes()
        write_bytes_atomic(out, library)
        write_bytes_atomic(out.with_suffix(".sha256"), hashlib.sha256(library).hexdigest().encode())


def intact(library: Path) -> bool:
    """Whether a cached library is there and has the digest recorded when it was built."""
    digest = library.with_suffix(".sha256")
    try:
        return hashlib.sha256(library.read_bytes()).hexdigest() == digest.read_text()
    except OSError:  # missing, or unreadable
        return False
