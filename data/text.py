"""The one rule for text that cannot be encoded, which every door that takes text calls: a
prompt, a message, a stop string, from the server's routes and from sample.py alike.

Usage:
    from data.text import check_text
    ids = tokenizer.encode(check_text(prompt, "prompt"))   # InputError naming "prompt"

A Python string can hold half of a UTF-16 surrogate pair alone (JSON's "\\ud83d", a command
line's bytes that are not UTF-8), but no text does, and UTF-8 cannot write one. Left to the
tokenizers, GPT-2's (tiktoken) would encode it as U+FFFD and a character table would call it
a character it lacks, so the model would see another text than it was given, or the
refusal would depend on the tokenizer. So it is refused here, before any tokenizer sees it.
"""

from __future__ import annotations

import re

from machine.errors import InputError

LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str) -> str:
    """`text` as it is, if it is text; an InputError naming `where` for a lone surrogate."""
    half = LONE_SURROGATE.search(text)
    if half is not None:
        raise InputError(f"{where} holds half a character (\\u{ord(half[0]):04x} at character "
                         f"{half.start()}, a UTF-16 surrogate without its pair), which is not "
                         f"text; send the whole character, or remove it")
    return text
