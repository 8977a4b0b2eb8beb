"""The tokenizer processes of data.prepare: each rebuilds the tokenizer once, then turns
batches of documents into token ids; ordered_map hands the batches out and gives the
results back in input order, with a bounded number in flight.

The results come back through files, not the pool's pipe. A result of more than a few
kilobytes is sent in several writes, and a process killed between two of them leaves
the pool's reader waiting for the rest forever, because the parent itself holds the
pipe's other end open. A file's name is a message short enough for one write, which
the kernel makes whole or not at all, so a killed process is always seen as killed.

Usage:
    for batch, (ids, starts, skipped) in ordered_map(tokenize_batch, batches, workers, meta):
        ...
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from multiprocessing import get_context
from typing import Any

import numpy as np

from data.chat import check_conversation, render_conversation
from data.documents import Batch, batch_texts, json_field, json_lines
from data.shards import token_dtype
from data.sources import DataError
from data.tokenizer import load_tokenizer
from machine.errors import UserError

CHAR_SEPARATOR = "\n\n"  # separates documents where the tokenizer has no end-of-text token (the char one)

worker: dict[str, Any] = {}
PR_SET_PDEATHSIG = 1  # from Linux's <sys/prctl.h>


class WorkerDied(UserError):
    """A tokenizer process ended without giving its result back (killed, most often by the
    kernel's out-of-memory killer). Nothing written is lost, and running again resumes."""


def init_worker(tokenizer_meta: dict | None, parent: int | None = None) -> None:
    """Ready a tokenizer process, or with parent None the main process that tokenizes
    alone. A pool's process leaves Ctrl-C to its parent, which stops the pool, and ends
    when its parent does."""
    if parent is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_with_parent(parent)
    if tokenizer_meta is not None:
        tokenizer = load_tokenizer(tokenizer_meta)
        worker["tokenizer"] = tokenizer
        worker["separator"] = np.array(separator_ids(tokenizer), dtype=np.uint32)


def end_with_parent(parent: int) -> None:
    """End this process when `parent`, the process that started it, ends, however it ends.
    A SIGKILL leaves the parent no time to stop its children, and a pool's worker would
    wait for work forever, because it holds both ends of the pool's pipe and so never sees
    it close. The parent's id comes from the parent itself, because a parent that died
    while this process was starting has already left it to another (init, or a subreaper),
    whose id this process would otherwise watch. On Linux the kernel kills this process as
    the parent ends (even while native code holds the interpreter, as rustbpe's merges do);
    everywhere, a thread also polls the parent."""
    kill_on_parent_death()
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()


def kill_on_parent_death() -> None:
    """Ask Linux to SIGKILL this process when its parent ends (prctl's PR_SET_PDEATHSIG); a
    no-op elsewhere, where watch_parent alone does it. Linux sends the signal when the
    thread that started this process ends, and the parents here start their children from
    the thread that then waits for them."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no C library to ask, or one without prctl
        pass


def watch_parent(parent: int) -> None:
    """Exit once this process is no longer `parent`'s child, because the parent has ended."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def separator_ids(tokenizer: Any) -> list[int]:
    if tokenizer.eot_token is not None:
        return [tokenizer.eot_token]
    return tokenizer.encode(CHAR_SEPARATOR)


def tokenize_batch(batch: Batch) -> tuple[np.ndarray, np.ndarray, int]:
    """A batch's token ids, each document preceded by the separator, where in them each
    document starts, and how many bad records were skipped (always 0, because a bad text stops
    the run). Empty documents are skipped."""
    if batch.chat:
        return tokenize_conversations(batch)
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
    return stream_ids(parts, tokenizer.vocab_size), np.array(starts, dtype=np.int64), 0


def stream_ids(parts: list, vocab_size: int) -> np.ndarray:
    """The parts' ids as one stream, in the smallest dtype that holds the vocabulary."""
    dtype = token_dtype(vocab_size)
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def tokenize_conversations(batch: Batch) -> tuple[np.ndarray, np.ndarray, int]:
    """tokenize_batch for conversations: each rendered by data/chat.py (it opens with
    <|bos|>, so no separator is needed). A bad one stops the run with its line, or with
    skip_bad is counted and left out."""
    tokenizer = worker["tokenizer"]
    parts, starts, n, skipped = [], [], 0, 0
    for where, messages in conversation_records(batch):
        try:
            if isinstance(messages, DataError):
                raise messages
            if messages is None:
                raise ValueError(f"it has no {batch.field!r} field (name the conversations' "
                                 f"field with --text-field)")
            ids, _ = render_conversation(tokenizer, check_conversation(messages))
        except (DataError, ValueError) as e:  # bad JSON, a bad conversation, or text that cannot be encoded
            if not batch.skip_bad:
                problem = str(e) if isinstance(e, DataError) else f"{where}: {e}; fix it"
                raise DataError(f"{problem}, or add --skip-bad to leave out such "
                                f"lines") from None
            skipped += 1
            continue
        starts.append(n)
        parts.append(np.array(ids, dtype=np.uint32))
        n += len(ids)
    return stream_ids(parts, tokenizer.vocab_size), np.array(starts, dtype=np.int64), skipped


def conversation_records(batch: Batch) -> list[tuple[str, object]]:
    """(where, the messages field) of each record; a line that is not JSON gives the
    DataError in place of its messages, so that skip_bad can count it."""
    if batch.kind == "parquet":
        return [(f"{batch.name} row {batch.line + i}", messages)
                for i, messages in enumerate(batch.data)]
    records = []
    for where, line in json_lines(batch):
        try:
            records.append((where, json_field(line, where, batch.field)))
        except DataError as e:
            records.append((where, e))
    return records


def alphabet_of(batch: Batch) -> str:
    """The characters of a batch, for the char tokenizer's first pass."""
    return "".join(set().union(*(set(text) for text, _ in batch_texts(batch))))


def ordered_map(fn: Callable[[Batch], Any], batches: Iterable[Batch], workers: int,
                tokenizer_meta: dict | None) -> Iterator[tuple[Batch, Any]]:
    """fn over the batches in worker processes, with the results in input order. At most
    four batches per worker are in flight, so that reading never runs far ahead of
    tokenizing and memory stays bounded whatever the corpus size, yet a worker never waits
    for the main process's next batch."""
    if workers <= 1:
        init_worker(tokenizer_meta)
        yield from ((batch, fn(batch)) for batch in batches)
        return
    # spawn, not fork, because a process that has imported torch (to train) may hold threads
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"),
                               initializer=init_worker, initargs=(tokenizer_meta, os.getpid()))
    pending: deque = deque()
    with tempfile.TemporaryDirectory(prefix="gptlab-results-") as folder:
        call = partial(call_into_file, fn, folder)
        try:
            for batch in batches:
                pending.append((batch, pool.submit(call, batch)))
                if len(pending) >= 4 * workers:
                    done, future = pending.popleft()
                    yield done, result_from_file(future.result())
            while pending:
                done, future = pending.popleft()
                yield done, result_from_file(future.result())
        except BrokenProcessPool:
            raise WorkerDied(f"a tokenizer process died (killed; the out-of-memory killer is "
                             f"the usual cause); run the same command again to resume after "
                             f"the last whole shard, with fewer --workers than {workers} if "
                             f"memory is short") from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def call_into_file(fn: Callable[[Batch], Any], folder: str, batch: Batch) -> str:
    """fn(batch) in a worker, pickled into a new file in folder; return the file's path."""
    result = fn(batch)
    fd, path = tempfile.mkstemp(dir=folder)
    with os.fdopen(fd, "wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def result_from_file(path: str) -> Any:
    """The result that call_into_file wrote, read once: the file is removed."""
    with open(path, "rb") as f:
        result = pickle.load(f)
    os.remove(path)
    return result
