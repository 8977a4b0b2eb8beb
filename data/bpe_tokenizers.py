"""The byte-level BPE tokenizers, encoded by tiktoken: GPT-2's (from a local ranks file) and
one trained on your corpus (data/bpe.py trains it).

Usage:
    from data.bpe_tokenizers import GPT2Tokenizer
    tok = GPT2Tokenizer()                      # 50,257 tokens, offline
    ids = tok.encode("Hello"); tok.decode(ids)

data/tokenizer.py's load_tokenizer builds these from their descriptions (to_meta), importing
this module only for data that uses them.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from data.specials import END_OF_TEXT, specials_meta


class TiktokenTokenizer:
    """Byte-level BPE encoded by tiktoken: `ranks` maps each token's bytes to its id, and the
    end-of-text special token comes after them."""

    def __init__(self, name: str, pattern: str, ranks: dict[bytes, int],
                 specials: tuple[str, ...] = ()) -> None:
        import tiktoken
        self.pattern, self.ranks = pattern, ranks
        # <|endoftext|> comes right after the table, as in GPT-2, and the added specials after it
        self.added = tuple(specials)
        self.specials = {END_OF_TEXT: len(ranks),
                         **{token: len(ranks) + 1 + i for i, token in enumerate(specials)}}
        self.enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=self.specials)
        self.eot_token = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        # ordinary, because "<|endoftext|>" written in a text is text, not the special token
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as a uint32 array, without a Python int per token."""
        return self.enc.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)


class GPT2Tokenizer(TiktokenTokenizer):
    """GPT-2's byte-level BPE (50,257 tokens), built from a local ranks file."""

    def __init__(self, specials: tuple[str, ...] = ()) -> None:
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str  # tiktoken's GPT-2 split pattern

        from data.assets import GPT2_RANKS_SHA256, gpt2_ranks_path

        ranks = load_tiktoken_bpe(str(gpt2_ranks_path()), expected_hash=GPT2_RANKS_SHA256)
        super().__init__("gpt2", r50k_pat_str, ranks, specials)

    def to_meta(self) -> dict:
        return {"kind": "gpt2", "vocab_size": self.vocab_size, **specials_meta(self.added)}


class BPETokenizer(TiktokenTokenizer):
    """A byte-level BPE trained on your corpus (data/bpe.py): `tokens` holds each token's
    bytes in id order, with the 256 single bytes among them; `pattern` splits text into the
    pieces that merges stay inside."""

    def __init__(self, tokens: list[bytes], pattern: str, specials: tuple[str, ...] = ()) -> None:
        missing = set(range(256)) - {t[0] for t in tokens if len(t) == 1}
        if len(set(tokens)) != len(tokens) or missing:
            raise ValueError("the token table has duplicates or lacks single bytes")
        self.tokens = tokens
        super().__init__("bpe", pattern, {t: i for i, t in enumerate(tokens)}, specials)

    @classmethod
    def from_meta(cls, meta: dict) -> BPETokenizer:
        """The tokenizer of a description that tokenizer_problem passed (its keys, types and
        size), so what is left to fail is the tokens' base64 and the table itself."""
        try:
            tokens = [base64.b64decode(t, validate=True) for t in meta["tokens"]]
            return cls(tokens, meta["pattern"], tuple(meta.get("specials", ())))
        except (TypeError, ValueError, binascii.Error) as e:
            raise ValueError(f"the bpe tokenizer's description is damaged ({e})") from None

    def to_meta(self) -> dict:
        # base64 keeps every token's bytes in JSON and in a weights_only checkpoint
        return {"kind": "bpe", "vocab_size": self.vocab_size, "pattern": self.pattern,
                "tokens": [base64.b64encode(t).decode("ascii") for t in self.tokens],
                **specials_meta(self.added)}
