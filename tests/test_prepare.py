"""The streaming preparation: every input format gives the same token stream, workers do not
change a byte, a killed or disk-full run resumes to the bytes of an uninterrupted one,
validation holds whole documents, old datasets load, and bad input is reported in one line."""

import gzip
import json
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from data.batches import get_batch
from data.bpe_tokenizers import GPT2Tokenizer
from data.documents import list_inputs
from data.loader import load_meta, load_split
from data.prepare import CHAR_SEPARATOR, prepare
from data.sources import DataError
from data.tokenizer import load_tokenizer
from tests.forked import python
from tests.output import error_line
from tests.processes import command_line, still_running
from tests.signals import as_from_a_terminal

REPO = Path(__file__).resolve().parent.parent


def make_documents(n: int = 120, seed: int = 0) -> list[str]:
    """Documents of a few lines each, some with non-ASCII text and blank lines."""
    rng = random.Random(seed)
    words = ["moon", "rose", "naïve", "café", "東京", "sword", "night", "42", "O!", "thee"]
    return ["\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
                      for _ in range(rng.randint(1, 6))) + rng.choice(["", "\n", "\n\n"])
            for _ in range(n)]


def write_corpus(folder: Path, docs: list[str], fmt: str) -> Path:
    """Write the documents in one of the input formats; return the path to give --input."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = b"".join(json.dumps({"id": i, "text": d}).encode() + b"\n" for i, d in enumerate(docs))
    if fmt == "txt":
        for i, doc in enumerate(docs):
            (folder / f"doc_{i:04d}.txt").write_text(doc, encoding="utf-8")
        return folder
    if fmt == "jsonl":
        (folder / "c.jsonl").write_bytes(lines)
    elif fmt == "jsonl.gz":
        (folder / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    elif fmt == "jsonl.zst":
        import zstandard
        (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}),
                       folder / "c.parquet", row_group_size=50)
    return folder / f"c.{fmt}"


def stream(out: Path) -> np.ndarray:
    """Every token of a prepared dataset, in stream order."""
    meta = load_meta(out)
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["shards"]])


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_every_format_gives_the_documents_separated_by_end_of_text(tmp_path, fmt):
    docs = make_documents()
    path = write_corpus(tmp_path / "in", docs, fmt)
    meta = prepare(list_inputs([path]), "gpt2", tmp_path / "out", str(path), shard_tokens=1000,
                   batch_bytes=1000)
    tok = GPT2Tokenizer()
    expected = tok.encode(docs[0])
    for doc in docs[1:]:
        expected += [tok.eot_token] + tok.encode(doc)
    assert stream(tmp_path / "out").tolist() == expected
    assert meta["documents"] == len(docs) and len(meta["shards"]) == -(-len(expected) // 1000)
    assert meta["max_token"] == max(expected)


def test_char_documents_are_separated_by_a_blank_line(tmp_path):
    docs = make_documents(30)
    path = write_corpus(tmp_path / "in", docs, "jsonl")
    meta = prepare(list_inputs([path]), "char", tmp_path / "out", "c", shard_tokens=500)
    text = load_tokenizer(meta["tokenizer"]).decode(stream(tmp_path / "out").tolist())
    assert text == CHAR_SEPARATOR.join(docs)


def test_a_corpus_worth_workers_prepares_without_sched_getaffinity(tmp_path, monkeypatch):
    # macOS and Windows have no os.sched_getaffinity; a corpus worth workers still prepares
    monkeypatch.delattr("os.sched_getaffinity")
    path = write_corpus(tmp_path / "in", make_documents(100), "jsonl")
    meta = prepare(list_inputs([path]), "char", tmp_path / "out", "c", batch_bytes=2000)
    assert meta["documents"] == 100


def test_more_workers_than_cores_are_refused_before_any_work(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(10), "jsonl")
    with pytest.raises(DataError, match=r"--workers 1000 is more than this process may use \(\d+ CPUs?"):
        prepare(list_inputs([path]), "char", tmp_path / "out", "c", workers=1000)
    assert not (tmp_path / "out").exists()


def test_one_worker_and_two_write_the_same_bytes(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(300), "jsonl")
    for workers in (1, 2):
        prepare(list_inputs([path]), "gpt2", tmp_path / f"w{workers}", "c", shard_tokens=1000,
                batch_bytes=2000, workers=workers)
    assert len(files(tmp_path / "w1")) > 5
    assert files(tmp_path / "w1") == files(tmp_path / "w2")


def test_validation_holds_the_last_whole_documents(tmp_path):
    docs = make_documents(200)
    path = write_corpus(tmp_path / "in", docs, "jsonl")
    meta = prepare(list_inputs([path]), "gpt2", tmp_path / "out", "c", shard_tokens=700)
    tok = GPT2Tokenizer()
    val = load_split(tmp_path / "out", "val")[:].tolist()
    assert val[0] == tok.eot_token  # it starts where a document does
    val_docs = tok.decode(val[1:]).split("<|endoftext|>")
    assert val_docs == docs[-len(val_docs):]
    total = meta["train_tokens"] + meta["val_tokens"]
    assert 0.05 * total < meta["val_tokens"] <= 0.1 * total


def test_a_text_of_one_document_is_split_inside_it(tmp_path):
    text = "".join(make_documents(50))
    meta = prepare(list_inputs([write_text(tmp_path / "one.txt", text)]), "char",
                   tmp_path / "out", "one", shard_tokens=333, batch_bytes=500)
    assert meta["documents"] == 1
    n = len(text)
    assert (meta["train_tokens"], meta["val_tokens"]) == (n - int(n * 0.1), int(n * 0.1))


def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_large_text_pieces_tokenize_as_the_whole_text(tmp_path):
    # a .txt file is read in pieces cut after newlines; BPE must not see the seams
    text = "\n".join(make_documents(80))
    path = write_text(tmp_path / "one.txt", text)
    prepare(list_inputs([path]), "gpt2", tmp_path / "out", "one", batch_bytes=300)
    assert stream(tmp_path / "out").tolist() == GPT2Tokenizer().encode(text)


def test_windows_cross_shard_boundaries_and_are_windows_of_the_stream(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(100), "jsonl")
    prepare(list_inputs([path]), "char", tmp_path / "out", "c", shard_tokens=97)
    train, whole = load_split(tmp_path / "out", "train"), stream(tmp_path / "out")
    assert len(train.pieces) > 20
    assert np.array_equal(train[90:310], whole[90:310])  # across three shards
    x, y = get_batch(train, block_size=64, batch_size=32, generator=torch.Generator().manual_seed(0))
    text = whole.astype(np.int64).tobytes()
    for row_x, row_y in zip(x, y, strict=True):
        assert row_x.numpy().tobytes() in text and torch.equal(row_x[1:], row_y[:-1])


def run_prepare(args: str, **popen) -> subprocess.Popen:
    """Run data.prepare's prepare() in a real subprocess; `args` sets its small batches and
    shards."""
    code = ("import sys; from data.documents import list_inputs; from data.prepare import prepare; "
            f"prepare(list_inputs([sys.argv[1]]), 'gpt2', sys.argv[2], 'c', {args})")
    return subprocess.Popen([sys.executable, "-c", code, *popen.pop("argv")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_killed_preparation_resumes_to_the_same_bytes(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(3000), "jsonl")
    options = "shard_tokens=400, batch_bytes=3000"
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run_prepare(options, argv=[str(path), str(whole)]).wait(timeout=300) == 0
    for kill_at in (3, 40):  # the whole shards on disk when the kill comes
        proc = run_prepare(options, argv=[str(path), str(cut)])
        while len(list(cut.glob("tokens_*.bin"))) < kill_at and proc.poll() is None:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (cut / "meta.json").exists(), "finished before the kill; use a longer corpus"
    assert run_prepare(options, argv=[str(path), str(cut)]).wait(timeout=300) == 0
    assert files(cut) == files(whole)


@pytest.mark.parametrize("kill_when", ["a worker starts", "shards are written"])
def test_a_killed_preparation_leaves_no_process_behind(tmp_path, kill_when):
    # the first moment is the risky one, because a worker started just before the kill looks
    # for its parent after it, and could end up watching the process that adopted it
    path = write_corpus(tmp_path / "in", make_documents(3000), "jsonl")
    proc = run_prepare("shard_tokens=400, batch_bytes=3000, workers=2",
                       argv=[str(path), str(tmp_path / "out")])
    parent, children, started = psutil.Process(proc.pid), [], False
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        children = parent.children(recursive=True)
        started = any("spawn_main" in command_line(child) for child in children)
        shards = list((tmp_path / "out").glob("tokens_*.bin"))
        if started and (kill_when == "a worker starts" or len(shards) >= 3):
            break
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    # read before the kill, because a worker that ends with its parent is a nameless zombie
    assert started, "the preparation ended before a worker started; use a longer corpus"
    assert not (tmp_path / "out" / "meta.json").exists()
    assert still_running(children, within=30) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_cleanly_in_one_line_and_the_same_command_resumes(tmp_path, signum):
    path = write_corpus(tmp_path / "in", make_documents(3000), "jsonl")
    command = [sys.executable, "-m", "data.prepare", "--input", str(path), "--tokenizer", "gpt2",
               "--shard-tokens", "300"]
    proc = subprocess.Popen([*command, "--out", str(tmp_path / "cut")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_terminal)
    while len(list((tmp_path / "cut").glob("tokens_*.bin"))) < 5 and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, (stderr, signal.getsignal(signal.SIGINT),
                                             signal.pthread_sigmask(signal.SIG_BLOCK, []))
    assert error_line(stderr, "interrupted") == (f"interrupted: run the same command again to "
                                                 f"resume {tmp_path / 'cut'} after its last "
                                                 f"whole shard")
    assert not (tmp_path / "cut" / "meta.json").exists()
    assert not list((tmp_path / "cut").glob(".tokens_*"))  # no half-written shard left
    for out in ("cut", "whole"):
        made = python([*command[1:], "--out", str(tmp_path / out)])
        assert made.returncode == 0, made.stderr
    assert files(tmp_path / "cut") == files(tmp_path / "whole")


def test_a_disk_that_fills_mid_write_stops_cleanly_and_resumes(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(600), "jsonl")
    options = "shard_tokens=1000, batch_bytes=3000"
    whole, full = tmp_path / "whole", tmp_path / "full"
    assert run_prepare(options, argv=[str(path), str(whole)]).wait(timeout=300) == 0

    def small_disk():  # files past 3 KB fail to grow, as on a full disk (EFBIG, not a signal)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
    code = "from data.prepare import main; from machine.errors import run_command; run_command(main)"
    result = subprocess.run([sys.executable, "-c", code, "--input", str(path), "--tokenizer",
                             "gpt2", "--out", str(full), "--shard-tokens", "1000"],
                            cwd=REPO, capture_output=True, text=True, preexec_fn=small_disk)
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(
        f"error: cannot write the dataset to {full} (File too large)")
    assert not (full / "meta.json").exists() and not list(full.glob(".tokens_*"))
    # the same command with room to write resumes (batches of the CLI's default size)
    whole_cli = tmp_path / "whole_cli"
    for out in (full, whole_cli):
        made = python(["-m", "data.prepare", "--input", str(path), "--tokenizer", "gpt2", "--out",
                       str(out), "--shard-tokens", "1000"])
        assert made.returncode == 0, made.stderr
    assert files(full) == files(whole_cli)


def test_another_command_into_a_dataset_folder_is_refused_and_force_replaces(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(20), "jsonl")
    first = prepare(list_inputs([path]), "char", tmp_path / "out", "c")
    assert prepare(list_inputs([path]), "char", tmp_path / "out", "c") == first  # already done
    with pytest.raises(DataError, match=r"holds another dataset \(other settings\); choose "
                                         r"another --out, or add --force to replace it"):
        prepare(list_inputs([path]), "gpt2", tmp_path / "out", "c")
    with path.open("a") as f:  # the same file, changed since
        f.write(json.dumps({"text": "One more line."}) + "\n")
    with pytest.raises(DataError, match=r"another dataset \(the same files before they changed\)"):
        prepare(list_inputs([path]), "char", tmp_path / "out", "c")
    other = write_corpus(tmp_path / "other", make_documents(20), "jsonl")
    with pytest.raises(DataError, match=r"another dataset \(other input files\)"):
        prepare(list_inputs([other]), "char", tmp_path / "out", "c")
    assert load_meta(tmp_path / "out") == first
    assert prepare(list_inputs([path]), "gpt2", tmp_path / "out", "c", force=True)["vocab_size"] == 50257


def test_a_dataset_from_before_shards_still_loads(tmp_path):
    ids = np.arange(300, dtype=np.uint16) % 50
    (tmp_path / "train.bin").write_bytes(ids[:270].tobytes())
    (tmp_path / "val.bin").write_bytes(ids[270:].tobytes())
    chars = "".join(chr(65 + i) for i in range(50))
    (tmp_path / "meta.json").write_text(json.dumps({
        "tokenizer": {"kind": "char", "vocab_size": 50, "chars": chars}, "vocab_size": 50,
        "dtype": "uint16", "train_tokens": 270, "val_tokens": 30}))
    train, val = load_split(tmp_path, "train"), load_split(tmp_path, "val")
    assert np.array_equal(train[:], ids[:270]) and np.array_equal(val[:], ids[270:])
    x, y = get_batch(val, block_size=8, batch_size=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 50


def bad_jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


@pytest.mark.parametrize("name, content, hide, message", [
    ("c.jsonl", bad_jsonl([b'{"text": "ok"}', b'{"text": "ok"}', b'{"text": "broken']), "",
     "c.jsonl line 3 is not valid JSON (Unterminated string starting at, column 10); fix or "
     "remove the line"),
    ("c.jsonl", bad_jsonl([b'{"text": "ok"}', b'{"body": "no text field"}']), "",
     "c.jsonl line 2 has no text in field 'text' (no such field); name the text field with "
     "--text-field"),
    ("c.jsonl", bad_jsonl([b'{"text": 7}']), "", "c.jsonl line 1 has no text in field 'text' (a int)"),
    ("c.jsonl", b'{"text": "caf\xe9"}\n', "", "c.jsonl line 1 is not valid UTF-8"),
    ("c.jsonl.gz", b"\x1f\x8b\x08\x00 not really gzip", "", "c.jsonl.gz cannot be decompressed"),
    ("c.txt", b"fine\nline\ncaf\xe9\n", "", "c.txt is not valid UTF-8 (byte offset 13, line 3)"),
    ("c.parquet", None, "", "c.parquet has no column 'text' (its columns: body); name the text "
                            "column with --text-field"),
    ("c.parquet", None, "pyarrow", "reading .parquet files needs pyarrow, which is not "
                                   "installed; run: pip install pyarrow"),
    ("c.jsonl.zst", b"", "zstandard", "reading .jsonl.zst files needs zstandard, which is not "
                                      "installed; run: pip install zstandard"),
])
def test_bad_input_is_one_line_naming_the_file_and_nothing_is_left(tmp_path, name, content,
                                                                    hide, message):
    path = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"body": ["a document"] * 10}), path)
    else:
        path.write_bytes(content)
    # hide a module as if it were not installed, so that importing it raises ImportError
    code = (f"import sys; sys.modules[{hide!r}] = None; " if hide else "import sys; ") + \
        "import runpy; sys.argv[0] = 'prepare'; runpy.run_module('data.prepare', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", code, "--input", str(path), "--out",
                             str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1
    assert message in error_line(result.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("first", ["corpus/a.txt", "corpus/../corpus/a.txt", "corpus"])
def test_a_file_given_twice_is_one_line_and_nothing_is_written(tmp_path, first):
    # the same file named twice, or inside a folder that is also given, would count twice
    (tmp_path / "corpus").mkdir()
    a = write_text(tmp_path / "corpus" / "a.txt", "To be, or not to be. " * 200)
    write_text(tmp_path / "corpus" / "b.txt", "That is the question. " * 200)
    result = python(["-m", "data.prepare", str(tmp_path / first), "--input", str(a), "--out",
                     str(tmp_path / "out")])
    assert result.returncode == 1
    also = f" (also as {tmp_path / first})" if "../" in first else ""
    assert error_line(result.stderr) == f"error: {a} is given twice{also}; give each corpus file once"
    assert not (tmp_path / "out").exists()


def test_a_lone_surrogate_escape_is_one_line_naming_the_line_and_nothing_is_left(tmp_path):
    # "\ud83d" is half of an emoji's UTF-16 pair: valid JSON, but no character
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "half an emoji: \\ud83d"}\n')
    result = python(["-m", "data.prepare", "--input", str(path), "--tokenizer", "gpt2", "--out",
                     str(tmp_path / "out")], timeout=120)
    assert result.returncode == 1
    assert error_line(result.stderr) == (
        f"error: {path} line 2 escapes half a character (\\ud83d without its pair), which no "
        f"text holds; fix or remove the line")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["jsonl.zst", "jsonl.gz"])
def test_a_compressed_file_cut_short_is_refused_not_read_as_whole(tmp_path, fmt):
    path = write_corpus(tmp_path / "in", make_documents(2000), fmt)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])  # a download that stopped halfway
    result = python(["-m", "data.prepare", "--input", str(path), "--out", str(tmp_path / "out")], timeout=120)
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(f"error: {path} cannot be decompressed")
    assert "fetch it again" in error_line(result.stderr)
    assert not (tmp_path / "out").exists()


def test_the_corpus_as_an_argument_is_the_same_as_input(tmp_path):
    # what a newcomer types first, by analogy with train.py, which takes its config file
    # as its first argument
    path = write_corpus(tmp_path / "in", make_documents(20), "jsonl")
    for out, argv in (("given", [str(path)]), ("named", ["--input", str(path)])):
        made = python(["-m", "data.prepare", *argv, "--tokenizer", "gpt2", "--out",
                       str(tmp_path / out)], timeout=120)
        assert made.returncode == 0, made.stderr
    assert files(tmp_path / "given") == files(tmp_path / "named")


def test_a_folder_of_another_tool_is_refused_and_kept(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(20), "jsonl")
    theirs = tmp_path / "nanogpt"  # nanoGPT's prepare.py writes these files, and no meta.json
    theirs.mkdir()
    for name in ("train.bin", "val.bin", "notes.txt"):
        (theirs / name).write_bytes(b"their bytes")
    result = python(["-m", "data.prepare", "--input", str(path), "--out", str(theirs)], timeout=120)
    assert result.returncode == 1
    assert error_line(result.stderr) == (f"error: {theirs} holds files that are no dataset of "
                                         f"ours (notes.txt, train.bin, val.bin); choose another "
                                         f"--out, or add --force to replace it")
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt", "train.bin", "val.bin"]
    assert all(p.read_bytes() == b"their bytes" for p in theirs.iterdir())


def test_a_second_preparation_into_a_folder_in_use_is_refused(tmp_path):
    path = write_corpus(tmp_path / "in", make_documents(3000), "jsonl")
    out = tmp_path / "out"
    first = run_prepare("shard_tokens=400, batch_bytes=3000", argv=[str(path), str(out)])
    while not list(out.glob("tokens_*.bin")) and first.poll() is None:
        time.sleep(0.005)
    second = python(["-m", "data.prepare", "--input", str(path), "--tokenizer", "gpt2", "--out",
                     str(out), "--force"], timeout=120)
    assert first.poll() is None, "the first finished too soon; use a longer corpus"
    assert second.returncode == 1
    assert error_line(second.stderr) == (f"error: {out} is being prepared by another command "
                                         f"that is still going; wait for it to end, or choose "
                                         f"another --out")
    assert first.wait(timeout=300) == 0
    whole = tmp_path / "whole"
    assert run_prepare("shard_tokens=400, batch_bytes=3000", argv=[str(path), str(whole)]).wait() == 0
    assert files(out) == files(whole)  # the first was not disturbed, and no orphan shard is left


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe"])
def test_windows_text_tokenizes_as_the_whole_file_in_any_pieces(tmp_path, tokenizer):
    # CRLF line ends, a byte-order mark, non-ASCII letters before line ends, and lines with
    # no letter at all; the pieces must be cut only where the split pattern always splits
    docs = make_documents(60, seed=3)
    text = "\r\n".join(d.replace("\n", "\r\n") for d in docs) + "\r\n12 34\r\n... !\r\n"
    path = tmp_path / "windows.txt"
    path.write_bytes("\ufeff".encode() + text.encode())
    whole = prepare(list_inputs([path]), tokenizer, tmp_path / "whole", "w", vocab_size=
                    300 if tokenizer == "bpe" else None, batch_bytes=1 << 20)
    cut = prepare(list_inputs([path]), str(tmp_path / "whole"), tmp_path / "cut", "w",
                  batch_bytes=200)
    tok = load_tokenizer(whole["tokenizer"])
    assert stream(tmp_path / "whole").tolist() == tok.encode(text)  # no U+FEFF in the data
    assert stream(tmp_path / "cut").tolist() == tok.encode(text)
    assert cut["documents"] == 1


def test_a_damaged_parquet_page_is_named_as_such_and_nothing_is_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": [f"document {i} with words" * 3 for i in range(5000)]}),
                   path, row_group_size=1000, compression="snappy")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 200] = bytes(b ^ 0xFF for b in data[middle:middle + 200])
    path.write_bytes(bytes(data))
    result = python(["-m", "data.prepare", "--input", str(path), "--out", str(tmp_path / "out")], timeout=120)
    assert result.returncode == 1
    report = error_line(result.stderr)
    assert report.startswith(f"error: {path} is damaged after row ")
    assert "fetch or write the file again" in report and "space" not in report
    assert not (tmp_path / "out").exists()


WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}.get(platform.machine())
KILLED_IN_A_WRITE = f'''
import os, signal, threading, time
from data.workers import WorkerDied, ordered_map

RESULT = b"x" * (16 << 20)

def waits_on_a_reader(thread: int) -> bool:
    """Whether the thread is blocked in a write() of more than 64 KiB, which a write to a
    pipe is while its reader has yet to take the bytes (Linux's /proc says so)."""
    with open(f"/proc/self/task/{{thread}}/syscall") as f:
        fields = f.read().split()  # "running", or the syscall's number and arguments
    return fields[0] == "{WRITE_SYSCALL}" and int(fields[3], 16) > 1 << 16

def die_in_a_pipe_write(batch):
    """RESULT, and a thread that kills this process if it hands RESULT back through a pipe."""
    def watch(thread):
        while not waits_on_a_reader(thread):
            time.sleep(0.0002)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, args=(threading.get_native_id(),), daemon=True).start()
    return RESULT

if __name__ == "__main__":
    try:
        [(_, result)] = ordered_map(die_in_a_pipe_write, [0], 2, None)
        print("whole" if result == RESULT else "not whole")
    except WorkerDied as e:
        print("died:", e)
'''


@pytest.mark.skipif(WRITE_SYSCALL is None or not Path("/proc/self/syscall").exists(),
                    reason="finds a blocked write through Linux's /proc")
def test_a_worker_killed_as_it_hands_back_its_result_leaves_no_one_waiting(tmp_path):
    # A worker killed halfway through handing back a large result must not leave the main
    # process waiting for the rest of it, as a large message on the pool's pipe would: the
    # result arrives whole, or the worker's death is the one line.
    script = tmp_path / "killed_in_a_write.py"
    script.write_text(KILLED_IN_A_WRITE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "whole\n" or done.stdout.startswith("died: a tokenizer process died"), \
        done.stdout


def test_a_killed_worker_is_one_line_and_the_same_command_resumes_whole(tmp_path):
    path = tmp_path / "big.jsonl"  # 16 batches of a megabyte, so work is left when a worker dies
    docs = make_documents(400)
    with path.open("w") as f:
        for i in range(160_000):
            f.write(json.dumps({"text": docs[i % len(docs)]}) + "\n")
    command = [sys.executable, "-m", "data.prepare", "--input", str(path), "--tokenizer", "gpt2",
               "--workers", "2", "--shard-tokens", "50000"]
    proc = subprocess.Popen([*command, "--out", str(tmp_path / "cut")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not list((tmp_path / "cut").glob("tokens_*.bin")) and proc.poll() is None:
        time.sleep(0.01)
    children = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "spawn_main"],
                              capture_output=True, text=True).stdout.split()
    os.kill(int(children[0]), signal.SIGKILL)  # as the out-of-memory killer does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert error_line(stderr).startswith("error: a tokenizer process died")
    assert "run the same command again to resume" in error_line(stderr)
    assert not (tmp_path / "cut" / "meta.json").exists()
    for out in ("cut", "whole"):
        made = python([*command[1:], "--out", str(tmp_path / out)])
        assert made.returncode == 0, made.stderr
    assert files(tmp_path / "cut") == files(tmp_path / "whole")
