"""The log-probability of every token of a sequence under the model: what a multiple-choice
evaluation sums (measure/choices.py) and what the server's `logprobs` and `echo` report.

Usage:
    from measure.logprobs import token_logprobs
    scored = token_logprobs(model, [[464, 3290, 318], [464, 3797]], top=5)
    scored[0].logprobs[1]    # log p(token 2 | tokens 0..1); logprobs[0] is None
    scored[0].top[1]         # the 5 likeliest tokens there, as (id, logprob), likeliest first
    scored[0].greedy[1]      # whether token 2 is the likeliest there

Sequences are scored together in batched forward passes: padded on the right, which a
causal model never sees from an earlier position, so a sequence's numbers do not depend on
what else is in the batch (beyond float rounding in the matrix products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from machine.errors import InputError
from model import GPT

LOGITS_BYTES = 256 * 2**20  # the most float32 logits one batch may hold; the other sequences wait


@dataclass
class Scored:
    """One sequence's numbers, a position each: logprobs[i] is log p(ids[i] | ids[:i]) (None
    at 0, which nothing predicts), top[i] the likeliest tokens there, greedy[i] whether
    ids[i] is the likeliest. With `following`, the logits (1, vocab) of the token after the
    sequence."""
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]
    greedy: list[bool]
    following: torch.Tensor | None = None


@torch.inference_mode()
def token_logprobs(model: GPT, sequences: list[list[int]], top: int = 0,
                   following: bool = False) -> list[Scored]:
    """Each sequence's log-probabilities, in its order. A sequence holds at least one token
    and at most block_size + 1, the last scored and never fed; InputError otherwise. With
    `following`, every token is fed (block_size at most), and the pass that scores the
    sequence also gives the logits of the token after it."""
    block_size, vocab = model.config.block_size, model.config.vocab_size
    longest = block_size if following else block_size + 1
    for ids in sequences:
        if not 1 <= len(ids) <= longest:
            raise InputError(f"a sequence of {len(ids)} tokens cannot be scored: this model "
                             f"scores 1 to {longest}")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InputError(f"token id {max(ids) if max(ids) >= vocab else min(ids)} is "
                             f"outside the vocabulary of {vocab:,}")
    device = model.lm_head.weight.device
    scored: list[Scored | None] = [None] * len(sequences)
    # the last token is fed only where what follows it is asked for
    fed = [ids if following else ids[:-1] or ids for ids in sequences]
    # longest first, so that a batch pads little; as many as keep its logits under the cap
    order = sorted(range(len(sequences)), key=lambda i: -len(fed[i]))
    while order:
        T = len(fed[order[0]])
        rows = max(1, LOGITS_BYTES // (T * vocab * 4))
        batch, order = order[:rows], order[rows:]
        idx = torch.zeros(len(batch), T, dtype=torch.long)
        for row, i in enumerate(batch):
            idx[row, :len(fed[i])] = torch.tensor(fed[i])
        logits, _ = model(idx.to(device))  # (B, T, vocab)
        logp = F.log_softmax(logits.float(), dim=-1).cpu()
        for row, i in enumerate(batch):
            scored[i] = score_row(logp[row], sequences[i], top)
            if following:
                scored[i].following = logits[row, len(sequences[i]) - 1][None].clone()
    return scored


def score_row(logp: torch.Tensor, ids: list[int], top: int) -> Scored:
    """One sequence's Scored from the log-softmax of its forward pass, (T, vocab)."""
    n = len(ids) - 1  # positions that predict a token of the sequence
    targets = torch.tensor(ids[1:], dtype=torch.long)
    chosen = logp[torch.arange(n), targets].tolist()
    best = logp[:n].argmax(dim=-1)
    greedy = (best == targets).tolist()
    alternatives: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    if top:
        values, indices = logp[:n].topk(top, dim=-1)
        alternatives = [list(zip(i.tolist(), v.tolist(), strict=True))
                        for i, v in zip(indices, values, strict=True)]
    return Scored([None, *chosen], [[], *alternatives], [False, *greedy])
