"""tokenizer.json, Hugging Face's tokenizer file, for each of this project's tokenizers. An
exported folder carries it, so that AutoTokenizer gives the ids that the project's own gives.

Usage:
    from data.tokenizer_json import tokenizer_files
    files = tokenizer_files(tokenizer)   # {"tokenizer.json": b"...", "tokenizer_config.json": ...,
                                         #  and a chat model's "chat_template.jinja"}

A BPE of ours (GPT-2's, or one trained here) is in tiktoken's form: a rank for every token's bytes.
tokenizer.json spells the same BPE as merges: each token of two bytes or more is made of
two shorter tokens, merged at its rank, and the pieces come from the same split pattern, so
both give the same ids. A character table becomes a BPE without merges, whose words are
never split by a pattern, so each character is its own token.
"""

from __future__ import annotations

import json

from data.bpe_tokenizers import TiktokenTokenizer
from data.chat import CHAT_TEMPLATE
from data.hf_tokenizer import HFTokenizer, byte_unicode
from data.specials import CHAT_SPECIALS, END_OF_TEXT
from data.tokenizer import CharTokenizer, Tokenizer


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges that build every token of `ranks` from its bytes, in rank order: for each
    token, every split into two tokens of lower rank. transformers' tiktoken converter lists
    them all too, because BPE may reach a token by more than one."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank]
        merges += sorted(splits, key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
    return merges


def byte_level_json(tokenizer: TiktokenTokenizer) -> dict:
    """tokenizer.json of a tiktoken BPE, with <|endoftext|> (and any chat tokens) as its
    special tokens."""
    spell = byte_unicode()

    def spelled(token: bytes) -> str:
        return "".join(spell[b] for b in token)
    vocab = {spelled(token): rank for token, rank in tokenizer.ranks.items()}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens(tokenizer),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tokenizer.pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab,
                  "merges": [[spelled(a), spelled(b)] for a, b in bpe_merges(tokenizer.ranks)]},
    }


def char_json(tokenizer: CharTokenizer) -> dict:
    """tokenizer.json of a character table: a BPE with no merges and no pre-tokenizer, so
    each character maps to its id, and a decoder that joins them as they are."""
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens(tokenizer),
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: i for i, c in enumerate(tokenizer.chars)}, "merges": []},
    }


def added_tokens(tokenizer: CharTokenizer | TiktokenTokenizer) -> list[dict]:
    return [{"id": id, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for content, id in tokenizer.specials.items()]


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json for an exported folder."""
    if isinstance(tokenizer, HFTokenizer):  # a folder's own, carried through training
        spec = json.loads(tokenizer.json_text)
    elif isinstance(tokenizer, CharTokenizer):
        spec = char_json(tokenizer)
    else:
        spec = byte_level_json(tokenizer)
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": 1_000_000}
    # a chat model's turn ends at <|assistant_end|>, a base model's text at <|endoftext|>
    roles = {"bos_token": ("<|bos|>", END_OF_TEXT), "eos_token": ("<|assistant_end|>", END_OF_TEXT)}
    for role, names in roles.items():
        found = next((name for name in names if name in special), None)
        if found:
            config[role] = found
    files = {"tokenizer.json": (json.dumps(spec, ensure_ascii=False) + "\n").encode(),
             "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}
    if all(token in special for token in CHAT_SPECIALS):  # a chat model's folder carries its format too
        files["chat_template.jinja"] = CHAT_TEMPLATE.encode()
    return files
