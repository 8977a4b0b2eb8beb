"""Tokenizers: text <-> token ids. The character-level one is here; GPT-2's BPE (offline)
and a BPE trained on your corpus, both encoded by tiktoken, are in data/bpe_tokenizers.py;
data/hf_tokenizer.py reads a Hugging Face folder's tokenizer.json, and tokenizer_json.py
writes ours in that format. load_tokenizer imports each only for data that uses it.

Usage:
    from data.tokenizer import CharTokenizer, load_tokenizer
    tok = CharTokenizer.from_text(text)
    ids = tok.encode("ROMEO:"); tok.decode(ids)
    tok = load_tokenizer(meta["tokenizer"])   # rebuild from the metadata a prepared dataset
                                              # or a checkpoint carries

A tokenizer describes itself with `to_meta()`, a plain dict that goes into meta.json and
checkpoints, so anything trained can always be decoded again.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from data.specials import END_OF_TEXT, specials_meta
from machine.errors import InputError
from machine.files import record_problem


class Tokenizer(Protocol):
    vocab_size: int
    eot_token: int | None  # end-of-text id, if the vocabulary has one
    specials: dict[str, int]  # special token -> id; only rendering gives these ids, never text

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> np.ndarray: ...
    def decode(self, ids: list[int]) -> str: ...
    def to_meta(self) -> dict: ...


class CharTokenizer:
    """One token per character of a fixed alphabet (the characters of the training text),
    then the special tokens, if any, each with an id that no character encodes to."""

    eot_token = None

    def __init__(self, chars: str, specials: tuple[str, ...] = ()) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("character table has duplicates")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.added = tuple(specials)
        self.specials = {token: len(chars) + i for i, token in enumerate(specials)}
        self.itos = [*chars, *specials]  # id -> its text
        self.vocab_size = len(self.itos)
        # code point -> id (-1 if not in the table), for encoding whole corpora at numpy speed
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
            raise InputError(
                f"{len(missing)} character(s) not in this model's vocabulary: {shown}; "
                f"the model only knows the characters of its training text"
            ) from None

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as an int32 array, for long texts: one numpy lookup, not a Python loop."""
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self.table[np.minimum(points, len(self.table) - 1)]
        if len(ids) and ids.min() < 0:
            self.encode(text)  # raises, naming the unknown characters
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)

    def to_meta(self) -> dict:
        return {"kind": "char", "vocab_size": self.vocab_size, "chars": self.chars,
                **specials_meta(self.added)}


# each kind, and the keys and types that its description (to_meta) must hold
RECORDS = {"char": {"vocab_size": int, "chars": str}, "gpt2": {"vocab_size": int},
           "bpe": {"vocab_size": int, "pattern": str, "tokens": list},
           "hf": {"vocab_size": int, "json": str}}
TOKENIZERS = ("char", "gpt2", "bpe")  # the kinds data.prepare makes; "hf" comes from a folder
GPT2_VOCAB_SIZE = 50257  # 50,000 merges, the 256 bytes and <|endoftext|>


def tokenizer_problem(meta: object) -> str | None:
    """What is wrong with a tokenizer's description read from disk (meta.json, a
    checkpoint), in a few words naming the key; None if it can be loaded. It builds nothing,
    so it is cheap enough to catch a damaged record where the file is read."""
    if not isinstance(meta, dict) or meta.get("kind") not in RECORDS:
        kind = meta.get("kind") if isinstance(meta, dict) else meta
        return f"its kind {kind!r:.40} is none of {', '.join(RECORDS)}"
    problem = record_problem(meta, RECORDS[meta["kind"]])
    kind, added = meta["kind"], meta.get("specials", [])
    if problem or kind == "hf":  # an hf tokenizer's size is known only once its file is read
        return problem
    if not isinstance(added, list) or not all(isinstance(t, str) for t in added) \
            or len(set(added)) != len(added) or END_OF_TEXT in added:
        return "its specials are not a list of distinct token names"
    # a BPE's table lacks <|endoftext|>, which comes after it
    size = (len(meta["chars"]) if kind == "char" else len(meta["tokens"]) + 1 if kind == "bpe"
            else GPT2_VOCAB_SIZE) + len(added)
    if size != meta["vocab_size"]:
        return f"its vocab_size is {meta['vocab_size']} for a table of {size} tokens"
    return None


def load_tokenizer(meta: dict) -> Tokenizer:
    """Rebuild the tokenizer that `to_meta()` described; raise ValueError if it is damaged."""
    problem = tokenizer_problem(meta)
    if problem:
        raise ValueError(f"the tokenizer's description is damaged: {problem}")
    kind, added = meta["kind"], tuple(meta.get("specials", ()))
    if kind == "char":
        return CharTokenizer(meta["chars"], added)
    if kind in ("gpt2", "bpe"):
        from data.bpe_tokenizers import BPETokenizer, GPT2Tokenizer
        return GPT2Tokenizer(added) if kind == "gpt2" else BPETokenizer.from_meta(meta)
    from data.hf_tokenizer import HFTokenizer  # only a folder's tokenizer needs `tokenizers`
    return HFTokenizer(meta["json"])
