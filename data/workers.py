"""The tokenizer processes of data.prepare: each rebuilds the tokenizer once, then turns
batches of documents into token ids; ordered_map hands the batches out and gives the
results back in input order, a bounded number in flight.

Usage:
    for batch, (ids, starts) in ordered_map(tokenize_batch, batches, workers, tokenizer_meta):
        ...
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import numpy as np

from data.documents import Batch, batch_texts
from data.shards import token_dtype
from data.sources import DataError
from data.tokenizer import load_tokenizer

CHAR_SEPARATOR = "\n\n"  # between two documents, for the char tokenizer (GPT-2's: <|endoftext|>)

worker: dict[str, Any] = {}


def init_worker(tokenizer_meta: dict | None, in_process: bool = False) -> None:
    if not in_process:  # Ctrl-C is the main process's to handle, and it stops the workers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if tokenizer_meta is not None:
        tokenizer = load_tokenizer(tokenizer_meta)
        worker["tokenizer"] = tokenizer
        worker["separator"] = np.array(separator_ids(tokenizer), dtype=np.uint32)


def exit_with_parent(parent: int) -> None:
    """A worker whose main process was killed (SIGKILL leaves no time to stop the pool)
    would wait for work forever: it goes too."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def separator_ids(tokenizer: Any) -> list[int]:
    if tokenizer.eot_token is not None:
        return [tokenizer.eot_token]
    return tokenizer.encode(CHAR_SEPARATOR)


def tokenize_batch(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """A batch's token ids, each document preceded by the separator, and where in them each
    document starts. Empty documents are skipped."""
    tokenizer, separator = worker["tokenizer"], worker["separator"]
    parts, starts, n = [], [], 0
    for text, starts_document in batch_texts(batch):
        if starts_document:
            if not text:
                continue
            starts.append(n)
            parts.append(separator)
            n += len(separator)
        try:
            parts.append(tokenizer.encode_array(text))
        except ValueError as e:  # a character outside the char tokenizer's table
            raise DataError(f"{batch.name}: {e}") from None
        n += len(parts[-1])
    dtype = token_dtype(tokenizer.vocab_size)
    ids = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    return ids, np.array(starts, dtype=np.int64)


def alphabet_of(batch: Batch) -> str:
    """The characters of a batch: the char tokenizer's first pass."""
    return "".join(set().union(*(set(text) for text, _ in batch_texts(batch))))


def usable_cores() -> int:
    """The cores this process may run on: its affinity on Linux (a container or taskset may
    allow fewer than the machine has), every core elsewhere, where there is no such call."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ordered_map(fn: Callable[[Batch], Any], batches: Iterable[Batch], workers: int,
                tokenizer_meta: dict | None) -> Iterator[tuple[Batch, Any]]:
    """fn over the batches in worker processes, results in input order. At most four batches
    a worker are in flight, so reading never runs ahead of tokenizing: memory stays bounded
    whatever the corpus size, and a worker never waits for the main process's next batch."""
    if workers <= 1:
        init_worker(tokenizer_meta, in_process=True)
        yield from ((batch, fn(batch)) for batch in batches)
        return
    # spawn, not fork: a process that has imported torch (a training start) may hold threads
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"),
                               initializer=init_worker, initargs=(tokenizer_meta,))
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append((batch, pool.submit(fn, batch)))
            if len(pending) >= 4 * workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
