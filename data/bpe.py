"""Train a byte-level BPE on your corpus, with rustbpe; tiktoken then encodes with it.

Usage:
    from data.bpe import train_bpe, train_bpe_apart
    tokenizer = train_bpe(texts, vocab_size=4096)   # texts: an iterable of str; a BPETokenizer
    meta = train_bpe_apart(make_texts, 4096)        # in a process of its own, so Ctrl-C stops it
    python -m data.prepare --input corpus/ --tokenizer bpe --vocab-size 4096

The vocabulary is the 256 bytes, vocab_size - 257 merges, and <|endoftext|>, which separates
documents. Text is first split by GPT-4's pattern (SPLIT_PATTERN: contractions, letter runs
with one leading non-letter, numbers of up to three digits, punctuation runs, whitespace), and
merges never cross those pieces, as in GPT-2 and nanochat.

rustbpe (nanochat's trainer) trains faster than Hugging Face tokenizers (docs/quality.md
has the figures) and gives tiktoken's ranks directly, so the encoder is tiktoken, the same
fast path as GPT-2's.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from multiprocessing import get_context
from multiprocessing.connection import Connection

from data.bpe_tokenizers import BPETokenizer
from data.sources import DataError
from data.workers import WorkerDied, end_with_parent

# GPT-4's split pattern (tiktoken's cl100k_base, as rustbpe has it by default)
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
MIN_VOCAB = 256 + 1  # every byte, and <|endoftext|>
MAX_VOCAB = 2**32


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"--vocab-size must be between {MIN_VOCAB} (the 256 bytes and "
                        f"<|endoftext|>) and 2^32, got {vocab_size:,}")


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A BPE of vocab_size tokens learned from `texts`; DataError if they are too few to
    learn that many merges."""
    import rustbpe
    check_vocab_size(vocab_size)
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(texts, vocab_size - 1, pattern=SPLIT_PATTERN)
    ranks = sorted(trainer.get_mergeable_ranks(), key=lambda pair: pair[1])
    if len(ranks) < vocab_size - 1:
        raise DataError(f"the corpus is too small to learn {vocab_size - MIN_VOCAB:,} merges: "
                        f"it gives {len(ranks) - 256:,}; lower --vocab-size to at most "
                        f"{len(ranks) + 1:,} or use more text")
    return BPETokenizer([token for token, _ in ranks], SPLIT_PATTERN)


def train_bpe_apart(texts: Callable[[], Iterable[str]], vocab_size: int) -> dict:
    """train_bpe's tokenizer description, trained in a process of its own. rustbpe's merges
    run in Rust and hold the interpreter for long on a large corpus, so in this process
    Ctrl-C or SIGTERM would wait for the training to end; instead this process waits on a
    pipe, answers a signal promptly, and ends the trainer. texts must pickle (a module's
    function, or a functools.partial of one), because the child reads the corpus itself."""
    context = get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    trainer = context.Process(target=train_in_child, args=(texts, vocab_size, send, os.getpid()),
                              daemon=True)
    trainer.start()
    send.close()
    try:
        while not receive.poll(0.1):
            if not trainer.is_alive():
                break
        kind, value = receive.recv()
    except EOFError:  # it ended without sending anything, so it was killed
        raise WorkerDied("the BPE trainer process died (killed; the out-of-memory killer is "
                         "the usual cause); run the same command again, with a smaller "
                         "--tokenizer-train-chars if memory is short") from None
    finally:
        if trainer.is_alive():
            trainer.terminate()
        trainer.join()
    if kind == "error":
        raise DataError(value)
    return value


def train_in_child(texts: Callable[[], Iterable[str]], vocab_size: int, send: Connection,
                   parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent answers Ctrl-C, and ends this
    end_with_parent(parent)
    try:
        send.send(("done", train_bpe(texts(), vocab_size).to_meta()))
    except DataError as e:
        send.send(("error", str(e)))
