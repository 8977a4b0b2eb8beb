"""Your own tokenizer: a BPE trained on the corpus travels in the dataset and in every
checkpoint, so sampling and evaluation need neither the dataset nor the network; it can be
reused on another corpus; and bad settings and damaged tokenizers each give a one-line
error."""

import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from data.bpe_tokenizers import BPETokenizer
from data.documents import list_inputs
from data.loader import load_meta
from data.prepare import prepare
from data.tokenizer import load_tokenizer
from tests.forked import python
from tests.output import error_line
from tests.signals import as_from_a_terminal

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "config" / "tiny.toml")


def cli(*args: str) -> subprocess.CompletedProcess:
    return python(list(args))


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory, corpus_file) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "plays_bpe"
    result = cli("-m", "data.prepare", "--input", str(corpus_file), "--tokenizer", "bpe",
                 "--vocab-size", "300", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_the_dataset_carries_its_bpe_and_its_ids_decode_to_the_corpus(bpe_dataset, corpus_file):
    meta = load_meta(bpe_dataset)
    tokenizer = load_tokenizer(meta["tokenizer"])
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == meta["vocab_size"] == 300
    assert tokenizer.eot_token == 299 and meta["max_token"] < 299  # one document, so no separator
    ids = np.fromfile(bpe_dataset / meta["shards"][0]["file"], dtype=np.uint16)
    assert tokenizer.decode(ids.tolist()) == corpus_file.read_text()
    assert len(ids) < 0.6 * len(corpus_file.read_text())  # it learned merges


def test_a_trained_bpe_is_reused_on_another_corpus(bpe_dataset, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                             ["ROMEO: the moon, the moon!", "JULIET: a rose\nby any name", "NURSE: ay"]
                             * 20))
    meta = prepare(list_inputs([other]), str(bpe_dataset), tmp_path / "out", "other")
    assert meta["tokenizer"] == load_meta(bpe_dataset)["tokenizer"]
    tokenizer = load_tokenizer(meta["tokenizer"])
    ids = np.fromfile(tmp_path / "out" / meta["shards"][0]["file"], dtype=np.uint16).tolist()
    assert ids[:ids.index(tokenizer.eot_token)] == tokenizer.encode("ROMEO: the moon, the moon!")


def test_sample_and_evaluate_run_from_the_checkpoint_alone(bpe_dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(bpe_dataset, data)
    result = cli("train.py", "--config", TINY, "--data-dir", str(data), "--out-dir",
                 str(tmp_path / "runs"), "--max-iters", "10", "--eval-interval", "10")
    assert result.returncode == 0, result.stderr
    shutil.rmtree(data)  # the tokenizer must come from the checkpoint now
    ckpt = tmp_path / "runs" / "tiny" / "best.pt"
    assert torch.load(ckpt, weights_only=True)["tokenizer"]["kind"] == "bpe"
    sampled = cli("sample.py", "--checkpoint", str(ckpt), "--prompt", "ROMEO:",
                  "--max-new-tokens", "20", "--attention", str(tmp_path / "att" / "a"))
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("ROMEO:") and (tmp_path / "att" / "a.html").exists()
    text = tmp_path / "play.txt"
    text.write_text("JULIET: Romeo loves the moon.\nNURSE: Tybalt fears a rose.\n" * 5)
    scored = cli("evaluate.py", "--checkpoint", str(ckpt), "--input", str(text), "--json",
                 str(tmp_path / "s.json"))
    assert scored.returncode == 0, scored.stderr
    scores = json.loads((tmp_path / "s.json").read_text())
    assert 0 < scores["bits_per_char"] < 8


def damaged_tokenizer(meta: dict) -> dict:
    tokens = meta["tokenizer"]["tokens"]
    return {**meta, "tokenizer": {**meta["tokenizer"], "tokens": tokens[:5] + ["%%"] + tokens[6:]}}


@pytest.mark.parametrize("args, message", [
    (["--tokenizer", "bpe", "--vocab-size", "200"],
     "--vocab-size must be between 257 (the 256 bytes and <|endoftext|>) and 2^32, got 200"),
    (["--tokenizer", "bpe", "--vocab-size", str(2**32 + 1)], "and 2^32, got 4,294,967,297"),
    (["--vocab-size", "1000"], "--vocab-size is for a BPE trained here; add --tokenizer bpe"),
    (["--tokenizer", "bpe", "--vocab-size", "90000"],
     "the corpus is too small to learn 89,743 merges"),
    (["--tokenizer", "{damaged}"], "holds no usable tokenizer (the bpe tokenizer's description "
                                   "is damaged"),
])
def test_bad_tokenizer_settings_are_one_line(args, message, tmp_path, corpus_file, bpe_dataset):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "meta.json").write_text(json.dumps(damaged_tokenizer(load_meta(bpe_dataset))))
    result = cli("-m", "data.prepare", "--input", str(corpus_file), "--out", str(tmp_path / "out"),
                 *[a.format(damaged=damaged) for a in args])
    assert result.returncode == 1
    assert message in error_line(result.stderr)
    assert not (tmp_path / "out").exists()


def test_a_damaged_tokenizer_in_a_dataset_or_a_checkpoint_is_one_line(bpe_dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(bpe_dataset, data)
    (data / "meta.json").write_text(json.dumps(damaged_tokenizer(load_meta(bpe_dataset))))
    trained = cli("train.py", "--config", TINY, "--data-dir", str(data), "--out-dir",
                  str(tmp_path / "runs"), "--max-iters", "2")
    assert trained.returncode == 1
    assert "meta.json: the bpe tokenizer's description is damaged" in error_line(trained.stderr)
    assert "prepare the dataset again" in error_line(trained.stderr)

    shutil.copytree(bpe_dataset, tmp_path / "good")
    assert cli("train.py", "--config", TINY, "--data-dir", str(tmp_path / "good"), "--out-dir",
               str(tmp_path / "runs"), "--max-iters", "2").returncode == 0
    ckpt = torch.load(tmp_path / "runs" / "tiny" / "last.pt", weights_only=True)
    torch.save(damaged_tokenizer(ckpt), tmp_path / "c.pt")
    sampled = cli("sample.py", "--checkpoint", str(tmp_path / "c.pt"), "--prompt", "A")
    assert sampled.returncode == 1
    assert "the bpe tokenizer's description is damaged" in error_line(sampled.stderr)
    assert "the checkpoint is damaged" in error_line(sampled.stderr)


def test_the_builtin_bpe_dataset_is_the_same_every_time(tmp_path):
    from data.prepare import prepare_builtin
    first = prepare_builtin("shakespeare_bpe2048", tmp_path / "a")
    again = prepare_builtin("shakespeare_bpe2048", tmp_path / "b")
    assert first["tokenizer"]["kind"] == "bpe" and first["vocab_size"] == 2048
    assert first["tokenizer"] == again["tokenizer"] and first["shards"] == again["shards"]


def test_ctrl_c_while_a_bpe_trains_is_answered_at_once(tmp_path):
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
             for _ in range(400_000)]
    corpus = tmp_path / "words.txt"  # enough merges to keep rustbpe busy in Rust when Ctrl-C comes
    corpus.write_text(" ".join(rng.choice(words) for _ in range(1_000_000)))
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", "--input", str(corpus),
                             "--tokenizer", "bpe", "--vocab-size", "60000", "--out",
                             str(tmp_path / "out")], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_terminal)
    trainer = []
    while not trainer and proc.poll() is None:
        trainer = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "spawn_main"],
                                 capture_output=True, text=True).stdout.split()
        time.sleep(0.02)
    time.sleep(1.0)  # let the training get going
    os.kill(int(trainer[0]), 0)  # raises if the trainer has already ended
    asked = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - asked < 3, "Ctrl-C waited for the training to end"
    assert proc.returncode == 130
    assert error_line(stderr, "interrupted").startswith("interrupted: run the same command")
    with pytest.raises(ProcessLookupError):  # the trainer ended with it
        os.kill(int(trainer[0]), 0)
