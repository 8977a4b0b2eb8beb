"""The batches a training run draws from a split, in a seeded stream: random windows of the
token stream (one may cross from a shard into the next, never from train into val), or whole
conversations of a chat dataset (data/chat.py).

Usage:
    from data.batches import BatchStream, batch_sampler
    draw = batch_sampler(splits["train"], meta, block_size=64, batch_size=12)
    x, y = BatchStream(draw, seed=1337).next()   # (12, 64) windows and their next tokens
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from data.loader import Tokens
from data.sources import DataError
from data.tokenizer import load_tokenizer


def get_batch(data: Tokens, block_size: int, batch_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size random windows: inputs x and next-token targets y, both (B, block_size) int64."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator).tolist()
    chunk = torch.from_numpy(np.stack([data[s:s + block_size + 1] for s in starts]).astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


Sampler = Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def batch_sampler(data: Tokens, meta: dict, block_size: int, batch_size: int,
                  say: Callable[[str], None] | None = None) -> Sampler:
    """How this split's batches are drawn: random windows of a corpus, or whole
    conversations of a chat dataset (`say` is told which are cut to fit block_size)."""
    if not meta.get("chat"):
        if len(data) <= block_size:
            raise DataError(f"block_size ({block_size}) must be smaller than the {data.split} "
                            f"split ({len(data)} tokens); lower block_size or use more text")
        return lambda generator: get_batch(data, block_size, batch_size, generator)
    from data.chat import Conversations  # imported here because only chat data needs it
    specials = load_tokenizer(meta["tokenizer"]).specials
    conversations = Conversations(data[0:len(data)], data.where, specials, block_size)
    if conversations.note and say is not None:
        say(conversations.note)
    return lambda generator: conversations.batch(batch_size, generator)


class BatchStream:
    """One process's stream of random training batches. Under torchrun every process draws the
    same stream and takes every world_size-th batch, as one process accumulating world_size times
    as many would. `state`, the generator's state before the last batch was drawn, goes into
    checkpoints, so that a resumed run draws that batch again and then the batches to come."""

    def __init__(self, draw: Sampler, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.draw, self.rank, self.world_size = draw, rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.state = self.generator.get_state()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y), (B, T) int64 each: windows at random places (get_batch) or
        conversations in x, and in y the same shifted by one token."""
        self.state = self.generator.get_state()
        # every process draws all the processes' batches, to keep the generators equal, and takes its own
        batches = [self.draw(self.generator) for _ in range(self.world_size)]
        return batches[self.rank]
