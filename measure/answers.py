"""Does a chat model answer right? Each conversation's last assistant turn is generated
greedily after the turns before it, and it counts only if it equals the expected text.

Usage:
    from measure.answers import answer_score, demo_conversations
    right, total = answer_score(model, tokenizer, demo_conversations())

A base model has no chat tokens, so it is scored the way SFT starts from it, with rows for
them added at the mean of the other rows (weights.loading.grow_vocabulary); the same command
then measures a model before and after fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.chat import ASSISTANT_END, check_conversation, render_prompt, special_ids, with_specials
from data.chat_demo import conversations
from data.documents import read_records
from data.sources import DataError
from data.specials import CHAT_SPECIALS
from data.tokenizer import Tokenizer, load_tokenizer
from generate import stream
from model import GPT
from weights.loading import grow_vocabulary

HELD_OUT_SEED, HELD_OUT = 1, 300  # the demo's training set is drawn with seed 0


def demo_conversations() -> list[dict]:
    return conversations(HELD_OUT, seed=HELD_OUT_SEED)


def read_conversations(path: Path) -> list[dict]:
    """Read a JSON Lines file of conversations, one {"messages": [...]} per line, checking
    each before a model is loaded; a bad line raises a DataError that names it."""
    records = []
    for where, record in read_records(path):
        try:
            check_conversation(record.get("messages") if isinstance(record, dict) else None)
        except ValueError as e:
            raise DataError(f"{where}: {e}; fix or remove the line") from None
        records.append(record)
    if not records:
        raise DataError(f"{path} holds no conversations; write one {{\"messages\": [...]}} "
                        f"per line")
    return records


def with_chat_tokens(model: GPT, tokenizer: Tokenizer) -> tuple[GPT, Tokenizer]:
    """Add the chat tokens to a base model and its tokenizer, as SFT does when it starts."""
    if all(t in tokenizer.specials for t in CHAT_SPECIALS):
        return model, tokenizer
    chat_tokenizer = load_tokenizer(with_specials(tokenizer.to_meta(), CHAT_SPECIALS))
    if chat_tokenizer.vocab_size > model.config.vocab_size:
        model = grow_vocabulary(model, chat_tokenizer.vocab_size).eval()
    return model, chat_tokenizer


@torch.no_grad()
def answer_score(model: GPT, tokenizer: Tokenizer, records: list[dict],
                 decode: str = "auto") -> tuple[int, int]:
    """Return (right, total): how many last replies the model, decoding greedily, gives exactly."""
    model, tokenizer = with_chat_tokens(model, tokenizer)
    end = special_ids(tokenizer)[ASSISTANT_END]
    right = 0
    for n, record in enumerate(records, 1):
        try:
            turns = check_conversation(record.get("messages") if isinstance(record, dict) else None)
            prompt = render_prompt(tokenizer, turns[:-1])
            expected = tokenizer.encode(turns[-1][1])
        except ValueError as e:
            raise DataError(f"conversation {n}: {e}") from None
        # leave room for the end token, and for a right answer that is tokenized differently
        # from the expected text
        budget = min(len(expected) + 8, model.config.block_size - len(prompt))
        if budget < 1:  # the question alone fills the context, so it is a miss
            continue
        idx = torch.tensor([prompt], device=model.lm_head.weight.device)
        got = []
        for token in stream(model, idx, budget, temperature=0.0, decode=decode):
            got.append(token.item())
            if got[-1] == end:
                break
        right += got[-1:] == [end] and tokenizer.decode(got[:-1]) == turns[-1][1]
    return right, len(records)
