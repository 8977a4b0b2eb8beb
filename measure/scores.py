"""A model's loss, perplexity and bits per character on a text, over sliding windows.

Usage:
    from measure.scores import evaluate
    scores = evaluate(model, tokenizer, text)       # Scores(loss=..., perplexity=..., ...)

A text longer than the model's window is scored with a sliding window, the rule of
transformers' perplexity guide: windows of block_size tokens start every `stride` tokens
(block_size // 2 by default), and each token after the first is scored once, in the first
window that reaches it, with the context that window gives it. A smaller stride gives
more context per token, and costs block_size / stride forward tokens per scored token.

The loss is in nats per predicted token, and depends on the tokenizer; bits per character
(the summed loss in bits over the characters of the predicted tokens) does not, so a
character model and GPT-2 can be compared on the same text.
"""


from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm import tqdm

from data.tokenizer import Tokenizer
from machine.errors import InputError
from machine.perf import check_room
from model import GPT, GPTConfig


@dataclass
class Scores:
    loss: float  # mean nats per predicted token
    perplexity: float
    bits_per_char: float
    tokens: int  # predicted (scored) tokens
    chars: int  # characters of the predicted tokens
    windows: int
    forward_tokens: int  # tokens the model ran, about block_size / stride per scored token
    seconds: float


def windows(n_tokens: int, block_size: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """Yield (begin, end, first) for each window ids[begin:end], which predicts the tokens
    first..end-1 that no earlier window predicted."""
    scored_to = 1  # token 0 has no context, so no window predicts it
    for begin in range(0, max(n_tokens - 1, 1), stride):
        end = min(begin + block_size, n_tokens)
        yield begin, end, scored_to
        scored_to = end
        if end == n_tokens:
            return


def check_stride(stride: int | None, block_size: int) -> int:
    """The stride to use: block_size // 2 by default; refuse one that leaves tokens unscored."""
    if block_size < 2:  # a window predicts each token after its first, so a window of one predicts none
        raise InputError(f"this model's block_size is {block_size}, and a window must hold a "
                         f"token and the one it predicts; evaluate.py scores models with "
                         f"block_size 2 or more")
    if stride is None:  # not given (0 is given, and refused below)
        stride = block_size // 2
    if not 1 <= stride < block_size:
        raise InputError(f"stride must be at least 1 and below block_size ({block_size}), so "
                         f"that windows overlap and no token goes unscored; got {stride}")
    return stride


def default_batch_size(config: GPTConfig, stride: int, logits_mb: int = 256) -> int:
    """Windows per forward pass: as many as keep a batch's scored logits (stride positions
    by vocabulary, in float32) under logits_mb, and at most 16, beyond which a CPU gains
    nothing (docs/quality.md has the measurements behind both limits)."""
    window_mb = logits_bytes(1, stride, config.vocab_size) / 2**20
    return max(1, min(16, int(logits_mb / window_mb)))


def logits_bytes(n_windows: int, stride: int, vocab_size: int) -> int:
    """Bytes of a batch's scored logits: stride positions per window, in float32."""
    return n_windows * stride * vocab_size * 4


def check_batch_memory(n_windows: int, stride: int, vocab_size: int,
                       device: torch.device) -> None:
    """Refuse a batch whose logits alone cannot fit in the memory free, rather than swap a
    CPU to a standstill."""
    check_room(f"a batch of {n_windows:,} windows",
               {"its logits": logits_bytes(n_windows, stride, vocab_size)}, device,
               "lower --batch-size, or leave it out", InputError)


@torch.inference_mode()
def evaluate(model: GPT, tokenizer: Tokenizer, text: str, stride: int | None = None,
             batch_size: int | None = None, progress: bool = False) -> Scores:
    """Score `text` with `model` (see the module docstring). Windows of equal length run in
    batches of batch_size (default_batch_size by default)."""
    block_size = model.config.block_size
    stride = check_stride(stride, block_size)
    batch_size = batch_size or default_batch_size(model.config, stride)
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise InputError(f"the text is {len(ids)} token(s) long; scoring needs at least 2")
    device = model.lm_head.weight.device
    tokens = torch.tensor(ids, device=device)
    spans = list(windows(len(ids), block_size, stride))
    check_batch_memory(min(batch_size, len(spans)), stride, model.config.vocab_size, device)
    # batch windows of the same length together; all but the last one or two are full
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for span in spans:
        by_length.setdefault(span[1] - span[0], []).append(span)
    batches = [group[i:i + batch_size] for group in by_length.values()
               for i in range(0, len(group), batch_size)]
    nll = torch.zeros((), dtype=torch.float64, device=device)
    t0 = time.perf_counter()
    # disable=None shows a bar only on a terminal, as in training, so logs get no carriage returns
    for batch in tqdm(batches, desc="evaluating", unit="batch",
                      disable=None if progress else True, dynamic_ncols=True, leave=False):
        # The whole window goes in, as in transformers' guide, although the last position's
        # prediction has no target, because the model then runs at its block size, the shape
        # it was trained at (and that kernels favour); causal attention keeps the extra token
        # out of earlier positions.
        x = torch.stack([tokens[begin:end] for begin, end, _ in batch])
        y = torch.stack([tokens[begin + 1:end] for begin, end, _ in batch])
        # y[:, j] is token begin + 1 + j. Targets before `first` were scored by an earlier
        # window, so their logits are not computed where no window of the batch needs them,
        # and they are masked out (-1 is ignored) where another window of the batch does.
        unscored = torch.tensor([first - begin - 1 for begin, _, first in batch], device=device)
        start = int(unscored.min())
        y = y[:, start:].masked_fill(
            torch.arange(start, y.size(1), device=device) < unscored[:, None], -1)
        logits = model(x, logits_from=start)[0][:, :-1]
        nll += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1,
                               reduction="sum").double()
    seconds = time.perf_counter() - t0
    nll_total = nll.item()
    n_scored = len(ids) - 1
    chars = len(text) - len(tokenizer.decode(ids[:1]))  # the first token is not predicted
    loss = nll_total / n_scored
    return Scores(loss=loss, perplexity=math.exp(loss),
                  bits_per_char=nll_total / math.log(2) / max(chars, 1), tokens=n_scored,
                  chars=chars, windows=len(spans),
                  forward_tokens=sum(end - begin for begin, end, _ in spans), seconds=seconds)
