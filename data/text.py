"""Text at the doors and on the way out: the one rule for text that cannot be encoded, which
every door that takes text calls (a prompt, a message, a stop string, from the server's
routes and from sample.py alike), and new tokens decoded to text as they arrive, cut before
a stop string.

Usage:
    from data.text import StopText, TextStream, check_text
    ids = tokenizer.encode(check_text(prompt, "prompt"))   # InputError naming "prompt"
    text = StopText(tokenizer, stop=("\n\n",)); piece = text.push(token_id)

A Python string can hold half of a UTF-16 surrogate pair alone (JSON's "\\ud83d", a command
line's bytes that are not UTF-8), but no text does, and UTF-8 cannot write one. Left to the
tokenizers, GPT-2's (tiktoken) would encode it as U+FFFD and a character table would call it
a character it lacks, so the model would see another text than it was given, or the
refusal would depend on the tokenizer. So it is refused here, before any tokenizer sees it.
"""

from __future__ import annotations

import codecs
import re

from data.tokenizer import Tokenizer
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


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string begins in text, or None."""
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=None)


class TextStream:
    """Decode tokens as they arrive. BPE tokens are byte sequences and one character may
    span several of them, so bytes wait until they complete a UTF-8 character. Special
    tokens (<|assistant_end|>, <|endoftext|>) are left out of the text unless
    skip_special_tokens is False, as vLLM and llama.cpp leave them out."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.bytes_of = getattr(tokenizer, "decode_bytes", None)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.skip = frozenset(tokenizer.specials.values() if skip_special_tokens else ())

    def push(self, ids: list[int]) -> str:
        """The text that these tokens complete (possibly empty)."""
        ids = [i for i in ids if i not in self.skip]
        if self.bytes_of is None:
            return self.tokenizer.decode(ids)
        return self.utf8.decode(self.bytes_of(ids))

    def flush(self) -> str:
        """Whatever is left once no more tokens come (an unfinished character as U+FFFD)."""
        return "" if self.bytes_of is None else self.utf8.decode(b"", final=True)


class StopText:
    """New tokens in, text out, cut before the first stop string. A stop string split
    across tokens is still found, because text is released only once no stop string can
    begin inside it. `stopped` says when one was met."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        if any(check_text(s, "a stop string") == "" for s in stop):  # raises InputError for non-text
            raise InputError("a stop string is empty, which would end every sample at once; "
                             "drop it or give some text")
        self.text, self.stop, self.stopped = TextStream(tokenizer, skip_special_tokens), stop, False
        self.held = ""  # decoded text not yet released
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token_id: int) -> str:
        """The text that token_id releases, maybe none."""
        self.held += self.text.push([token_id])
        cut = first_stop(self.held, self.stop)
        if cut is not None:
            self.stopped = True
            released, self.held = self.held[:cut], ""
            return released
        keep = len(self.held) - self.hold
        released, self.held = self.held[:max(keep, 0)], self.held[max(keep, 0):]
        return released

    def flush(self) -> str:
        """What is left once the tokens end."""
        held, self.held = self.held + self.text.flush(), ""
        return held[:first_stop(held, self.stop)]
