"""The special tokens: ids that rendering gives and text never spells.

Usage:
    from data.specials import CHAT_SPECIALS, END_OF_TEXT
"""

END_OF_TEXT = "<|endoftext|>"  # separates documents in BPE data (GPT-2's)
# nanochat's conversation tokens (data/chat.py renders with them): a conversation opens with
# <|bos|>, and each turn sits between its role's start and end
CHAT_SPECIALS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                 "<|assistant_end|>")
