"""Documents from corpus files of every format, read as batches of work for the tokenizers.

Usage:
    from data.documents import list_inputs, read_batches, batch_texts
    inputs = list_inputs(["corpus/", "web.jsonl.zst"])    # files, checked before any work
    for batch in read_batches(inputs):                     # the main process reads bytes
        for text, starts_document in batch_texts(batch):   # a worker parses and decodes
            ...

The formats, one row each in FORMATS:
- `.txt`: the whole file is one document, UTF-8 (a byte-order mark at its start is not
  text, and is dropped). A large file is read in pieces of about BATCH_BYTES, cut just
  before a line break (\\n or \\r) that follows a letter or digit, because the split
  patterns of GPT-2's and GPT-4's BPE always split there (a run of letters or digits never
  takes whitespace, and a run of whitespace depends only on what follows it). So the
  pieces tokenize as the whole file would, CRLF line ends included. A piece with no such line
  break in 4 x BATCH_BYTES (a file of one endless line) is cut before a space that follows
  a letter or digit, for the same reason, and only failing that at a character boundary.
- `.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one JSON object per line, the document in its text
  field (`--text-field`, default "text"). Blank lines are skipped.
- `.parquet`: one document per row of the text column.

A folder is read recursively, its files of these formats in path order; a file named on the
command line with another suffix is read as text. A record without the field, or whose
field is not a string, stops the run and names the file and line (or row), so nothing is
skipped silently. Reading and decoding are split so that the main process only moves bytes
and the workers do the parsing, in parallel.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from data.sources import DataError

BATCH_BYTES = 1 << 20  # text per unit of work, large enough to amortise the hand-off
PARQUET_ROWS = 512


class ZstdFrames(io.RawIOBase):
    """The frames of a .zst file, decompressed as they are read. zstandard's own stream
    reader ends quietly where the file ends, even inside a frame, so a download cut short
    would read as a whole, shorter file; this raises EOFError there instead, as gzip does."""

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard
        self.raw, self.new_frame = raw, zstandard.ZstdDecompressor().decompressobj
        self.frame, self.inside = self.new_frame(), False
        self.out, self.at = b"", 0  # decompressed bytes not yet read, from self.at

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        while self.at == len(self.out):
            data = self.raw.read(1 << 20)
            if not data:
                if self.inside:
                    raise EOFError("the file ends inside a zstd frame: it was cut short, "
                                   "as a download that stopped")
                return 0
            self.out, self.at = b"", 0
            while data:
                self.out += self.frame.decompress(data)
                self.inside = not self.frame.eof
                data = self.frame.unused_data if self.frame.eof else b""
                if self.frame.eof:  # the next frame, if any, starts in what was left
                    self.frame = self.new_frame()
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n


def open_zstd(raw: BinaryIO) -> BinaryIO:
    return io.BufferedReader(ZstdFrames(raw))


# suffix -> (record kind, opener of the decompressed stream, the module it needs or "")
FORMATS: dict[str, tuple[str, Callable[[BinaryIO], BinaryIO], str]] = {
    ".txt": ("text", lambda raw: raw, ""),
    ".jsonl": ("jsonl", lambda raw: raw, ""),
    ".jsonl.gz": ("jsonl", lambda raw: gzip.GzipFile(fileobj=raw), ""),
    ".jsonl.zst": ("jsonl", open_zstd, "zstandard"),
    ".parquet": ("parquet", lambda raw: raw, "pyarrow"),
}


@dataclass(frozen=True)
class Input:
    """One corpus file, or text held in memory (`data`), and the suffix that says its format."""
    name: str
    suffix: str
    size: int
    data: bytes | None = None

    def open(self) -> BinaryIO:
        if self.data is not None:
            return io.BytesIO(self.data)
        try:
            return open(self.name, "rb")
        except OSError as e:
            raise DataError(f"cannot read {self.name} ({e.strerror}); check that the file "
                            f"is there and readable") from None


@dataclass(frozen=True)
class Batch:
    """A unit of work: raw bytes of text or JSON lines, or Parquet strings, with where they
    came from so that a worker's error can name the file and line."""
    name: str
    kind: str                  # "text", "jsonl" or "parquet"
    data: bytes | list
    line: int                  # first line (or, for parquet, row) of data, counted from 1
    offset: int                # byte offset of data in the decompressed file
    continues: bool = False    # with text, data continues the previous batch's document
    field: str = "text"
    read: int = 0              # bytes of the file on disk consumed so far (progress)
    chat: bool = False         # records are conversations (data/chat.py), not texts
    skip_bad: bool = False     # with chat, count a bad conversation and go on instead of stopping


def format_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(FORMATS, key=len, reverse=True) if name.endswith(s)), None)


def list_inputs(paths: list[str | Path]) -> list[Input]:
    """Every corpus file under `paths`, in order, each checked to exist and be readable by
    the modules installed here, before any work starts."""
    inputs = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and format_of(p))
            if not found:
                raise DataError(f"no corpus files in folder {path}; give .txt, .jsonl, "
                                f".jsonl.gz, .jsonl.zst or .parquet files")
            inputs += [Input(str(p), format_of(p), p.stat().st_size) for p in found]
        elif path.is_file():
            inputs.append(Input(str(path), format_of(path) or ".txt", path.stat().st_size))
        else:
            raise DataError(f"input {path} does not exist; give a file or a folder of files")
    seen: dict[Path, str] = {}
    for item in inputs:  # a file given twice, or given with its folder, would count twice
        resolved = Path(item.name).resolve()
        if resolved in seen:
            also = f" (also as {seen[resolved]})" if seen[resolved] != item.name else ""
            raise DataError(f"{item.name} is given twice{also}; give each corpus file once")
        seen[resolved] = item.name
    for suffix in {i.suffix for i in inputs}:
        module = FORMATS[suffix][2]
        if module:
            try:
                __import__(module)
            except ImportError:
                raise DataError(f"reading {suffix} files needs {module}, which is not "
                                f"installed; run: pip install {module}") from None
    return inputs


def read_batches(inputs: list[Input], text_field: str = "text", batch_bytes: int = BATCH_BYTES,
                 chat: bool = False, skip_bad: bool = False) -> Iterator[Batch]:
    """The corpus as batches, in input order. The same files give the same batches on every
    run, which is what lets an interrupted preparation resume at a batch. With chat, the
    field holds conversations (OpenAI's messages), which .txt files cannot hold."""
    done = 0
    for item in inputs:
        kind = FORMATS[item.suffix][0]
        if chat and kind == "text":
            raise DataError(f"{item.name}: conversations come in .jsonl (a line holds "
                            f'{{"messages": [...]}}) or .parquet files, not text')
        if kind == "parquet":
            batches = parquet_batches(item, text_field, chat)
        else:
            batches = stream_batches(item, kind, text_field, batch_bytes)
        for batch in batches:
            yield replace(batch, read=done + batch.read, chat=chat, skip_bad=skip_bad)
        done += item.size


def stream_batches(item: Input, kind: str, field: str, batch_bytes: int) -> Iterator[Batch]:
    raw = item.open()
    try:
        stream = FORMATS[item.suffix][1](raw)
        line, offset, carry, first = 1, 0, b"", True
        while True:
            try:
                block = stream.read(batch_bytes)
            except Exception as e:  # gzip, zlib and zstandard each have their own errors
                raise DataError(f"{item.name} cannot be decompressed ({e}); the file is "
                                f"damaged or not {item.suffix}: fetch it again") from None
            if offset == 0 and not carry and block.startswith(BOM):  # drop a byte-order mark,
                block, offset = block[len(BOM):], len(BOM)  # which Windows tools write
            if kind == "text":  # check before cutting, because a NUL may lie past the cut
                refuse_binary(block, item.name, offset + len(carry))
            data = carry + block
            if not data:
                return
            cut = cut_point(data, kind, len(data) >= 4 * batch_bytes) if block else len(data)
            if cut == 0:  # no place to cut yet, so read on
                carry = data
                continue
            piece, carry = data[:cut], data[cut:]
            yield Batch(item.name, kind, piece, line, offset, continues=not first, field=field,
                        read=raw.tell())
            line += piece.count(b"\n")
            offset += len(piece)
            first = False
    finally:
        raw.close()


def cut_point(data: bytes, kind: str, force: bool) -> int:
    """Where to end this batch: after the last whole line of JSON, or for text just before
    the last line break that a letter or digit precedes (see the module docstring)."""
    if kind == "jsonl":
        return data.rfind(b"\n") + 1
    cut = last_cut(data, (b"\n", b"\r"))
    if cut or not force:
        return cut
    cut = last_cut(data, (b" ", b"\t"))
    if cut:
        return cut
    cut = len(data)  # failing that, cut before the last character that starts here
    while cut > 1 and data[cut - 1] & 0xC0 == 0x80:
        cut -= 1
    return max(cut - 1, 1)


def parquet_batches(item: Input, field: str, chat: bool = False) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        parquet = pq.ParquetFile(item.name)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{item.name} is not a readable Parquet file ({e}); check the "
                        f"file") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataError(f"{item.name} has no column {field!r} (its columns: "
                        f"{', '.join(schema.names)}); name the text column with --text-field")
    column = schema.field(field).type
    if chat and not (pa.types.is_list(column) or pa.types.is_large_list(column)):
        raise DataError(f"{item.name}: column {field!r} holds {column}, not a list of "
                        f"messages; name the conversations' column with --text-field")
    if not chat and not (pa.types.is_string(column) or pa.types.is_large_string(column)):
        raise DataError(f"{item.name}: column {field!r} holds {column}, not text; name the "
                        f"text column with --text-field")
    rows, total = 0, max(parquet.metadata.num_rows, 1)
    batches = parquet.iter_batches(batch_size=PARQUET_ROWS, columns=[field])
    while True:
        try:
            record_batch = next(batches, None)
        # a damaged page is an error of this input (pyarrow raises OSError), which must not
        # read as a disk that cannot be written
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{item.name} is damaged after row {rows} ({e}); fetch or write "
                            f"the file again") from None
        if record_batch is None:
            return
        texts = record_batch.column(0).to_pylist()
        yield Batch(item.name, "parquet", texts, rows + 1, 0, field=field,
                    read=item.size * (rows + len(texts)) // total)
        rows += len(texts)


BOM = "\ufeff".encode()


def last_cut(data: bytes, breaks: tuple[bytes, ...]) -> int:
    """The last position in data of one of `breaks` that a letter or digit precedes (0 if
    none), which is a place where BPE's split patterns always split."""
    end = len(data)
    while (i := max(data.rfind(b, 1, end) for b in breaks)) > 0:
        start = i - 1  # step back over UTF-8's continuation bytes to the character before
        while start > 0 and i - start < 4 and data[start] & 0xC0 == 0x80:
            start -= 1
        if data[start:i].decode("utf-8", errors="replace").isalnum():
            return i
        end = i
    return 0


# lone halves of a UTF-16 surrogate pair, which JSON may escape one at a time; alone they
# are not a character, and no tokenizer encodes them faithfully
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def batch_texts(batch: Batch) -> list[tuple[str, bool]]:
    """The texts of a batch, each with whether it starts a document. Runs in a worker."""
    if batch.kind == "text":
        return [(decode_text(batch.data, batch.name, batch.offset, batch.line), not batch.continues)]
    if batch.kind == "parquet":
        for i, text in enumerate(batch.data):
            if text is None:
                raise DataError(f"{batch.name} row {batch.line + i} has no {batch.field!r} "
                                f"(null); remove the row or fill it")
        return [(text, True) for text in batch.data]
    texts = []
    for where, line in json_lines(batch):
        text = json_field(line, where, batch.field)
        if not isinstance(text, str):
            got = "no such field" if text is None else f"a {type(text).__name__}"
            raise DataError(f"{where} has no text in field {batch.field!r} ({got}); name the "
                            f"text field with --text-field")
        if (half := LONE_SURROGATE.search(text)) is not None:  # JSON's "\ud83d" alone
            raise DataError(f"{where} escapes half a character (\\u{ord(half[0]):04x} without "
                            f"its pair), which no text holds; fix or remove the line")
        texts.append((text, True))
    return texts


def json_lines(batch: Batch) -> Iterator[tuple[str, bytes]]:
    """The non-blank lines of a JSON Lines batch, each with its file and line number."""
    for i, line in enumerate(batch.data.split(b"\n")):
        if line.strip():
            yield f"{batch.name} line {batch.line + i}", line


def json_field(line: bytes, where: str, field: str) -> object:
    """The value of `field` in a line's JSON object (None where it has none); DataError for a
    line that is not JSON."""
    record = parse_json(line, where)
    return record.get(field) if isinstance(record, dict) else None


class RepeatedKey(ValueError):
    """A JSON object that gives one key twice; the key is the message."""


def parse_json(line: bytes, where: str, unique_keys: bool = False) -> object:
    """The value of one line of JSON Lines; DataError naming `where` for a line that is not
    UTF-8 or not JSON, a number longer than Python reads, a nesting deeper than it follows,
    and with unique_keys an object that gives a key twice (which value counts would be a
    guess)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not valid UTF-8 (byte {e.start + 1} of the line); "
                        f"convert the file to UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=refuse_repeated_keys if unique_keys else None)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg}, column {e.colno}); fix or "
                        f"remove the line") from None
    except RepeatedKey as e:
        raise DataError(f"{where} gives the key {e} twice; keep one") from None
    except ValueError as e:  # an integer past Python's limit on digits
        raise DataError(f"{where} is not JSON that can be read ({e}); fix or remove the "
                        f"line") from None
    except RecursionError:
        raise DataError(f"{where} nests its JSON deeper than it can be read; fix or remove "
                        f"the line") from None


def refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict; RepeatedKey for the first key that comes twice."""
    record: dict[str, object] = {}
    for key, value in pairs:
        if key in record:
            raise RepeatedKey(repr(key))
        record[key] = value
    return record


def read_records(path: str | Path) -> list[tuple[str, object]]:
    """Each non-blank line of a JSON Lines file read whole (a task's items, conversations to
    score), parsed, with where it stands: "items.jsonl line 3". A byte-order mark at the
    start is dropped, and CRLF line ends read as LF, as in a corpus. DataError naming the
    line for one that parse_json refuses, a key given twice included."""
    path = Path(path)
    lines = path.read_bytes().removeprefix(BOM).split(b"\n")
    return [(f"{path} line {n}", parse_json(line, f"{path} line {n}", unique_keys=True))
            for n, line in enumerate(lines, 1) if line.strip()]


# --- plain text: one file, or a folder of .txt files, read exactly ---------------------------

def decode_text(data: bytes, where: str, offset: int = 0, line: int = 1) -> str:
    """Strict UTF-8 decoding with an error that points at the offending byte; `data` starts
    at byte `offset` and line `line` of the file `where`."""
    refuse_binary(data, where, offset)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line += data.count(b"\n", 0, e.start)
        raise DataError(f"{where} is not valid UTF-8 (byte offset {offset + e.start}, line "
                        f"{line}); convert it to UTF-8 first") from None


def refuse_binary(data: bytes, where: str, offset: int = 0) -> None:
    """A NUL byte means a binary file (an image, an archive), so say that, rather than where
    its bytes first fail as UTF-8."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{where} is not text (NUL byte at offset {offset + nul}); give a UTF-8 "
                        f"text file")


def read_text(path: str | Path) -> str:
    """The exact text of a UTF-8 file; or of every *.txt file under a folder, in path order,
    each exactly, with a blank line between two files (one newline after a file that ends
    in one, two after a file that does not)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"no .txt files in folder {path}; put your text in .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"input {path} does not exist; give a text file or a folder of .txt files")
    texts = [decode_text(f.read_bytes(), str(f)) for f in files]
    text = "".join(t + ("" if i == len(texts) - 1 else "\n" if t.endswith("\n") else "\n\n")
                   for i, t in enumerate(texts))
    if not text.strip():
        raise DataError(f"input {path} holds no text")
    return text
