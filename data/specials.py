"""The special tokens: ids that rendering gives and text never spells.

Usage:
    from data.specials import CHAT_SPECIALS, END_OF_TEXT
"""

END_OF_TEXT = "<|endoftext|>"  # GPT-2's; it separates documents in BPE data
# nanochat's conversation tokens, which data/chat.py renders with: a conversation opens
# with <|bos|>, and each turn sits between its role's start and end
CHAT_SPECIALS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                 "<|assistant_end|>")


def specials_meta(added: tuple[str, ...]) -> dict:
    """A description's "specials" key: the special tokens added after the table, in id
    order. The key is left out when there are none, so older files' descriptions still match."""
    return {"specials": list(added)} if added else {}
