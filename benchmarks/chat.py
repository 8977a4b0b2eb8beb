"""What the chat's kept KV cache buys: the time to the first token of turn N when the cache
holds the conversation so far (the turn prefills its own tokens), against re-prefilling the
whole history, for growing N. The model is a random-weight shape with a character vocabulary
of its size, and every turn's user text and reply are turn_tokens long.

Usage:
    python -m benchmarks.chat                               # GPT-2's shape, 8 turns
    python -m benchmarks.chat --preset baby_gpt --turns 3 --turn-tokens 32
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import typer

from data.specials import CHAT_SPECIALS
from data.tokenizer import CharTokenizer
from generate import Chat
from machine.device import cpu_name
from measure.decoding import benchmark_model


def chat_tokenizer(vocab_size: int) -> CharTokenizer:
    """Characters from U+0100 on (below the surrogates for any GPT-2-sized vocabulary), and
    the chat tokens, making a vocabulary as large as the shape's."""
    return CharTokenizer("".join(chr(0x100 + i) for i in range(vocab_size - len(CHAT_SPECIALS))),
                         CHAT_SPECIALS)


def first_token_seconds(chat: Chat, text: str, keep_cache: bool) -> float:
    """Add a user turn and time its reply's first token, then put the chat back as it was."""
    turns, ids, cached = list(chat.turns), list(chat.ids), chat.cached
    chat.add_user(text)
    if not keep_cache:
        chat.cached = 0  # prefill the whole history again, as a chat without a kept cache does
    start = time.perf_counter()
    reply = chat.reply()
    next(reply)
    seconds = time.perf_counter() - start
    reply.close()
    chat.turns, chat.ids, chat.cached = turns, ids, cached
    return seconds


def main(preset: str = "gpt2", layout: str = "gpt2", turns: int = 8, turn_tokens: int = 48,
         repeats: int = 3, decode: str = "auto") -> None:
    """Print the first-token latency of each turn, kept cache against re-prefilling."""
    if min(turns, turn_tokens, repeats) < 1:
        raise typer.BadParameter("--turns, --turn-tokens and --repeats must be at least 1")
    model, what = benchmark_model(None, preset, layout, 0)
    tokenizer = chat_tokenizer(model.config.vocab_size)
    chat = Chat(model, tokenizer, max_new_tokens=turn_tokens, temperature=0.0, decode=decode)
    rng = random.Random(0)
    print(f"{what}; {cpu_name()}, {torch.get_num_threads()} threads; medians of {repeats}")
    print(f"{'turn':>4} {'history':>8} {'kept cache ms':>14} {'re-prefill ms':>14} {'ratio':>6}")
    for n in range(1, turns + 1):
        text = "".join(rng.choice(tokenizer.chars) for _ in range(turn_tokens))
        if len(chat.rendered(chat.turns, text)) + turn_tokens > model.config.block_size:
            print(f"turn {n} would not fit in block_size {model.config.block_size}; stopping")
            break
        kept = statistics.median(first_token_seconds(chat, text, True) for _ in range(repeats))
        fresh = statistics.median(first_token_seconds(chat, text, False) for _ in range(repeats))
        history = len(chat.ids)
        chat.add_user(text)
        for _ in chat.reply():  # the turn itself, so the next one has a longer history
            pass
        print(f"{n:>4} {history:>8} {1000 * kept:>14.1f} {1000 * fresh:>14.1f} "
              f"{fresh / kept:>6.1f}")


if __name__ == "__main__":
    typer.run(main)
