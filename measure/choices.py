"""Multiple-choice tasks scored as EleutherAI's lm-evaluation-harness scores them: HellaSwag,
ARC, MMLU and nanochat's CORE are all of this kind.

Usage:
    python evaluate.py --task hellaswag.jsonl --init-from models/gpt2 --json scores.json

    from measure.choices import read_items, score_items
    items = read_items("hellaswag.jsonl")       # HellaSwag's fields, or context/choices/answer
    scores = score_items(model, tokenizer, items)  # acc, acc_norm, their standard errors, ...

Each choice is scored by the log-likelihood of " " + the choice after the context (lm-eval's
default target delimiter), tokenized as lm-eval tokenizes a pair: the context's trailing
spaces move to the continuation, and the continuation's tokens are those of the whole text
past the context's. `acc` counts the items whose answer has the highest summed
log-likelihood; `acc_norm` first divides each by the choice's length in characters, so that
long choices do not lose for being long. `centered` is nanochat's CORE measure: the accuracy
above chance, as a fraction of the room above chance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from data.documents import read_records
from data.sources import DataError
from data.text import check_text
from data.tokenizer import Tokenizer
from machine.errors import InputError
from measure.logprobs import token_logprobs
from model import GPT

DELIMITER = " "  # between the context and a choice, as lm-eval's target_delimiter


@dataclass(frozen=True)
class Item:
    context: str
    choices: list[str]
    answer: int
    where: str = "an item"  # its file and line, for error messages


def read_items(path: str | Path) -> list[Item]:
    """Read a JSON Lines task with {"ctx", "endings", "label"} (HellaSwag's own fields) or
    {"context", "choices", "answer"} on each line; a bad line raises a DataError naming it."""
    items = [item_of(record, where) for where, record in read_records(path)]
    if not items:
        raise DataError(f"{path} holds no items; write one JSON object per line")
    return items


def item_of(record: object, where: str) -> Item:
    fields = next((f for f in (("ctx", "endings", "label"), ("context", "choices", "answer"))
                   if isinstance(record, dict) and set(f) <= record.keys()), None)
    if fields is None:
        raise DataError(f"{where}: give ctx, endings and label (HellaSwag's fields) or "
                        f"context, choices and answer")
    context, choices, answer = (record[f] for f in fields)
    for text in (context, *choices) if isinstance(choices, list) else (context,):
        if isinstance(text, str):
            check_text(text, where)  # a lone surrogate is not text, so refuse it
    # HellaSwag's labels are strings of ASCII digits ("²" is a digit that int() refuses)
    if isinstance(answer, str) and answer.isascii() and answer.isdigit():
        answer = int(answer)
    if not (isinstance(context, str) and isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c for c in choices) and isinstance(answer, int)
            and not isinstance(answer, bool) and 0 <= answer < len(choices)):
        raise DataError(f"{where}: the context must be text, the choices two or more texts, "
                        f"and the answer the index of one of them")
    return Item(context, choices, answer, where)


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Return the context's ids and the continuation's, split as lm-eval splits a pair: the
    context's trailing spaces move to the continuation, whose ids are those of the whole text
    past the context's. An empty context becomes the tokenizer's start token."""
    if not context:
        return [start_id(tokenizer)], tokenizer.encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def encode_item(tokenizer: Tokenizer, item: Item, block_size: int,
                ) -> list[tuple[list[int], list[int]]]:
    """Return an item's context and continuation ids, one pair per choice. Raise an InputError
    naming the item for text the tokenizer cannot encode, and for a continuation longer than
    the model's context, which lm-eval refuses too, because every continuation token is scored
    and the first would have no context token left before it."""
    try:
        pairs = [encode_pair(tokenizer, item.context, DELIMITER + choice)
                 for choice in item.choices]
    # a character outside a character vocabulary; an empty context without a start token
    except (ValueError, DataError) as e:
        raise InputError(f"{item.where}: {e}") from None
    for n, (_, continuation) in enumerate(pairs):
        if len(continuation) > block_size:
            raise InputError(f"{item.where}: choice {n} is {len(continuation):,} tokens, more "
                             f"than the model's context of {block_size:,}, so it cannot be "
                             f"scored (lm-eval refuses it too); shorten the choice, or use a "
                             f"model with a longer context")
    return pairs


def start_id(tokenizer: Tokenizer) -> int:
    """The token that stands for an empty context: <|bos|> if there is one, else end-of-text."""
    start = tokenizer.specials.get("<|bos|>", tokenizer.eot_token)
    if start is None:
        raise DataError("the context is empty, and this tokenizer has no start token to "
                        "stand for it; give the item a context")
    return start


@dataclass
class Scores:
    acc: float
    acc_norm: float
    acc_stderr: float
    acc_norm_stderr: float
    centered: float  # (acc - chance) / (1 - chance), where chance is the mean of 1 / choices
    centered_stderr: float
    items: int


def score_items(model: GPT, tokenizer: Tokenizer, items: list[Item], batch_size: int = 64,
                progress: bool = False) -> Scores:
    """Score every item's choices, at most batch_size sequences per forward pass, and return
    the accuracies and their standard errors (lm-eval's: the sample standard deviation over
    the square root of the count)."""
    block_size = model.config.block_size
    pairs = [pair for item in items for pair in encode_item(tokenizer, item, block_size)]
    # as lm-eval does, keep the last block_size + 1 tokens and score the continuation's
    sequences = [(ctx + cont)[-(block_size + 1):] for ctx, cont in pairs]
    sums = []
    for start in tqdm(range(0, len(sequences), batch_size), desc="scoring", unit="batch",
                      disable=not progress):
        batch = sequences[start:start + batch_size]
        for (_, cont), scored in zip(pairs[start:start + batch_size],
                                     token_logprobs(model, batch), strict=True):
            sums.append(sum(scored.logprobs[-len(cont):]) if cont else 0.0)
    right, right_norm, chance, at = [], [], [], 0
    for item in items:
        lls = sums[at:at + len(item.choices)]
        at += len(item.choices)
        normed = [ll / len(choice) for ll, choice in zip(lls, item.choices, strict=True)]
        right.append(float(max(range(len(lls)), key=lls.__getitem__) == item.answer))
        right_norm.append(float(max(range(len(normed)), key=normed.__getitem__) == item.answer))
        chance.append(1 / len(item.choices))
    acc, baseline = mean(right), mean(chance)
    return Scores(acc, mean(right_norm), stderr(right), stderr(right_norm),
                  (acc - baseline) / (1 - baseline), stderr(right) / (1 - baseline), len(items))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def stderr(values: list[float]) -> float:
    """The standard error of the mean, with the sample standard deviation (n - 1)."""
    if len(values) < 2:
        return math.nan
    mu = mean(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1) / len(values))
