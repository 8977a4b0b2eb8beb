"""A Hugging Face folder's tokenizer.json, encoded by the `tokenizers` library: a
byte-level BPE (NanoChat's, GPT-2's) or a character table as data/tokenizer_json.py writes
one. Its special tokens keep their ids, and text that spells one ("<|bos|>") stays text.

Usage:
    from data.hf_tokenizer import HFTokenizer
    tokenizer = HFTokenizer(Path("models/nanochat/tokenizer.json").read_text())
    ids = tokenizer.encode("Hello"); tokenizer.decode(ids)
"""

from __future__ import annotations

import json

import numpy as np

from data.specials import END_OF_TEXT


class HFTokenizer:
    """A tokenizer.json, as the module docstring says; raises ValueError for a file it
    cannot read."""

    def __init__(self, json_text: str) -> None:
        from tokenizers import Tokenizer as Backend

        try:
            spec = json.loads(json_text)
            model = spec.get("model") or {}
        except (json.JSONDecodeError, AttributeError, RecursionError):
            raise ValueError("not a tokenizer file (it is not a JSON record)") from None
        if not isinstance(model, dict) or model.get("type") != "BPE":
            kind = model.get("type") if isinstance(model, dict) else model
            raise ValueError(f"it holds a {kind} model; only byte-level BPE (and this "
                             f"project's character tables) can be read")
        try:
            self.backend = Backend.from_str(json_text)
        except Exception as e:  # the library's own error type is not exported
            raise ValueError(f"the tokenizers library cannot read it "
                             f"({str(e).splitlines()[0]})") from None
        self.json_text = json_text
        self.backend.encode_special_tokens = True  # text never becomes a special token
        vocab = self.backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.specials = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special}
        self.special_ids = set(self.specials.values())
        # a document's natural start: nanochat's <|bos|>, GPT-2's <|endoftext|>
        self.eot_token = next((vocab[t] for t in ("<|bos|>", END_OF_TEXT) if t in vocab), None)
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self.byte_of = {c: b for b, c in byte_unicode().items()} if byte_level else None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.array(self.encode(text), dtype=np.uint32)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The bytes of these tokens, where a character may be cut between two of them."""
        if self.byte_of is None:
            return self.decode(ids).encode("utf-8")
        pieces = []
        for i in ids:
            token = self.backend.id_to_token(i) or ""
            pieces.append(token.encode("utf-8") if i in self.special_ids
                          else bytes(self.byte_of[c] for c in token))
        return b"".join(pieces)

    def to_meta(self) -> dict:
        return {"kind": "hf", "vocab_size": self.vocab_size, "json": self.json_text}


def byte_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE files spell tokens: the
    printable Latin-1 bytes stand for themselves, the others (control bytes, the space) for
    the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
