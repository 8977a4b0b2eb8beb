"""Tokenizers: text <-> token ids. Character-level, and GPT-2 BPE through tiktoken (offline).

Usage:
    from tokenizer import CharTokenizer, load_tokenizer
    tok = CharTokenizer.from_text(text)
    ids = tok.encode("ROMEO:"); tok.decode(ids)
    tok = load_tokenizer(meta["tokenizer"])   # rebuild from the metadata a prepared dataset
                                              # or a checkpoint carries

A tokenizer describes itself with `to_meta()`, a plain dict that goes into meta.json and
checkpoints, so anything trained can always be decoded again.
"""

from __future__ import annotations

import codecs
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    eot_token: int | None  # end-of-text id, if the vocabulary has one

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> np.ndarray: ...
    def decode(self, ids: list[int]) -> str: ...
    def to_meta(self) -> dict: ...


class CharTokenizer:
    """One token per character of a fixed alphabet (the characters of the training text)."""

    eot_token = None

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("character table has duplicates")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        # code point -> id (-1: not in the table), for encoding whole corpora at numpy speed
        self.table = np.full(max(map(ord, chars), default=0) + 2, -1, dtype=np.int32)
        self.table[[ord(c) for c in chars]] = np.arange(len(chars))

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            missing = sorted(set(text) - self.stoi.keys())
            shown = ", ".join(repr(c) for c in missing[:10])
            if len(missing) > 10:
                shown = f"the first 10, {shown}"
            raise ValueError(
                f"{len(missing)} character(s) not in this model's vocabulary: {shown}; "
                f"the model only knows the characters of its training text"
            ) from None

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as an int32 array, about 50 times faster on long texts."""
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self.table[np.minimum(points, len(self.table) - 1)]
        if len(ids) and ids.min() < 0:
            self.encode(text)  # raises, naming the unknown characters
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_meta(self) -> dict:
        return {"kind": "char", "vocab_size": self.vocab_size, "chars": self.chars}


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 tokens) via tiktoken, built from a local ranks file."""

    def __init__(self) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        # tiktoken's own definition of the GPT-2 split pattern and end-of-text token
        from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

        from assets import GPT2_RANKS_SHA256, gpt2_ranks_path

        ranks = load_tiktoken_bpe(str(gpt2_ranks_path()), expected_hash=GPT2_RANKS_SHA256)
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={ENDOFTEXT: len(ranks)})
        self.eot_token = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        # ordinary: "<|endoftext|>" written in a text is text, not the special token
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as a uint32 array, without a Python int per token."""
        return self.enc.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)

    def to_meta(self) -> dict:
        return {"kind": "gpt2", "vocab_size": self.vocab_size}


class TextStream:
    """Decode tokens as they arrive. BPE tokens are byte sequences and one character may
    span several of them, so bytes wait until they complete a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bytes_of = getattr(tokenizer, "decode_bytes", None)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        """The text that these tokens complete (possibly empty)."""
        if self.bytes_of is None:
            return self.tokenizer.decode(ids)
        return self.utf8.decode(self.bytes_of(ids))

    def flush(self) -> str:
        """Whatever is left once no more tokens come (an unfinished character as U+FFFD)."""
        return "" if self.bytes_of is None else self.utf8.decode(b"", final=True)


TOKENIZERS = ("char", "gpt2")


def load_tokenizer(meta: dict) -> CharTokenizer | GPT2Tokenizer:
    """Rebuild the tokenizer that `to_meta()` described."""
    kind = meta.get("kind")
    if kind == "char":
        return CharTokenizer(meta["chars"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZERS)}")

