"""The special tokens: ids that rendering gives and text never spells.

Usage:
    from data.specials import CHAT_SPECIALS, END_OF_TEXT
"""

END_OF_TEXT = "<|endoftext|>"  # separates documents in BPE data (GPT-2's)
# nanochat's conversation tokens (data/chat.py renders with them): a conversation opens with
# <|bos|>, and each turn sits between its role's start and end
CHAT_SPECIALS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                 "<|assistant_end|>")


def specials_meta(added: tuple[str, ...]) -> dict:
    """A description's "specials" key: the special tokens added after the table, in id
    order (absent where there are none, so older descriptions read as they were written)."""
    return {"specials": list(added)} if added else {}
