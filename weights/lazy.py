"""Weights not read yet: a base model's tensors as their shapes and a way to read each one
from a memory-mapped file, one at a time.

Usage:
    from weights.lazy import Lazy, build, cropped, expected, grown, state_dict_mismatch
    state = {"transformer.wte.weight": Lazy(torch.Size([50257, 768]), read_it), ...}
    model = build(config, state)                   # a plain GPT, every tensor read
    config, state = cropped(config, state, 256)     # a shorter context
    config, state = grown(config, state, 50260)     # room for the chat tokens
    state_dict_mismatch(expected(config), state, "config.json")   # None, or what does not fit

A model sharded across processes (training under FSDP) reads its base this way: each
process reads one tensor at a time and keeps its own rows of it, so none ever holds the
whole base model (training/distributed.shard_model). Read from a checkpoint (mapped, not
loaded), a process reads only the pages its rows lie in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from model import GPT, GPTConfig


class Lazy(NamedTuple):
    """A tensor not read yet: its shape, and how to read it whole."""
    shape: torch.Size
    load: Callable[[], torch.Tensor]

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor],
             shape: torch.Size | None = None) -> Lazy:
        """This tensor with fn applied as it is read (shape is the result's, if fn changes it)."""
        return Lazy(self.shape if shape is None else shape, lambda: fn(self.load()))


def mapped(tensors: dict[str, torch.Tensor]) -> dict[str, Lazy]:
    """Tensors that are at hand (or mapped from a file) as Lazy ones."""
    return {name: Lazy(t.shape, lambda t=t: t) for name, t in tensors.items()}


def expected(config: GPTConfig) -> dict[str, torch.Tensor]:
    """The state_dict of a model of this shape on the meta device, which takes no memory.
    ValueError for a shape with a tensor larger than torch can describe (a damaged size)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return GPT(config).state_dict()
    except RuntimeError as e:  # "Storage size calculation overflowed"
        raise ValueError(f"a model of this shape has a tensor too large for any machine "
                         f"({str(e).splitlines()[0]})") from None


def state_dict_mismatch(expected: dict[str, torch.Tensor], found: dict[str, Any],
                        shape_source: str) -> str | None:
    """Why `found` cannot load into a model whose state_dict is `expected` (names missing or
    unexpected, or the first wrong shape), in a few words; None if it can."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [k for k in expected
             if k in found and getattr(found[k], "shape", None) != expected[k].shape]
    if missing:
        return f"missing {', '.join(missing[:3])}"
    if unexpected:
        return f"unexpected {', '.join(unexpected[:3])}"
    if wrong:
        shape = getattr(found[wrong[0]], "shape", None)
        return (f"{wrong[0]} is {tuple(shape) if shape is not None else 'not a tensor'} but "
                f"{shape_source} implies {tuple(expected[wrong[0]].shape)}")
    return None


def build(config: GPTConfig, state: dict[str, Lazy]) -> GPT:
    """A plain GPT of this shape holding the weights (each read now)."""
    model = GPT(config)
    model.load_state_dict({name: lazy.load() for name, lazy in state.items()})
    return model


def cropped(config: GPTConfig, state: dict[str, Lazy],
            block_size: int | None) -> tuple[GPTConfig, dict[str, Lazy]]:
    """Shorten the context where block_size is below the model's, keeping the position
    table's first rows (rotary positions are computed for the new length)."""
    if block_size is None or block_size >= config.block_size:
        return config, state
    state = dict(state)
    wpe = state.get("transformer.wpe.weight")
    if wpe is not None:
        state["transformer.wpe.weight"] = wpe.then(lambda t: t[:block_size],
                                                   torch.Size([block_size, wpe.shape[1]]))
    return replace(config, block_size=block_size), state


def grown(config: GPTConfig, state: dict[str, Lazy],
          vocab_size: int) -> tuple[GPTConfig, dict[str, Lazy]]:
    """Rows added to the token table (and an untied head and the bigram table) for the ids
    from the vocabulary's size up to vocab_size. Each new row starts at the mean of the old
    ones, which gives an embedding and a logit like an average token's, so that the new
    tokens neither dominate the first steps nor start unreachable. The bigram table's last
    row, which stands for no predecessor, stays the last."""
    def grow(rows: torch.Tensor) -> torch.Tensor:
        extra = rows.float().mean(dim=0, keepdim=True).to(rows.dtype)
        return torch.cat([rows, extra.expand(vocab_size - len(rows), -1)])
    state = dict(state)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        if name in state:
            state[name] = state[name].then(grow, torch.Size([vocab_size, state[name].shape[1]]))
    if (bigrams := state.get("transformer.wtb.weight")) is not None:
        state["transformer.wtb.weight"] = bigrams.then(
            lambda rows: torch.cat([grow(rows[:-1]), rows[-1:]]),
            torch.Size([vocab_size + 1, bigrams.shape[1]]))
    return replace(config, vocab_size=vocab_size), state
