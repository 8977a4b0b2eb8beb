"""Tokenizers round-trip, prepared bins decode back to the source, batches are windows, and
damaged prepared data is one clear error."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from data.assets import sha256_bytes, shakespeare_text
from data.batches import get_batch
from data.bpe_tokenizers import GPT2Tokenizer
from data.documents import read_text
from data.loader import load_meta, load_split
from data.prepare import prepare_text
from data.sources import DataError
from data.tokenizer import CharTokenizer, load_tokenizer

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak!\n"


def test_char_tokenizer_round_trips():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.vocab_size == len(set(TEXT))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert load_tokenizer(tok.to_meta()).encode(TEXT) == tok.encode(TEXT)


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer.from_text("abc")
    for encode in (tok.encode, tok.encode_array):
        with pytest.raises(ValueError, match=r"2 character\(s\) not in this model's vocabulary: 'x', 'z'"):
            encode("zax")


@pytest.mark.parametrize("make", [lambda: CharTokenizer.from_text(TEXT + "東京é"), GPT2Tokenizer])
def test_encode_array_gives_the_ids_of_encode(make):
    tok, text = make(), TEXT + "東京é" * 3
    assert tok.encode_array(text).tolist() == tok.encode(text)


def test_char_tokenizer_says_when_it_lists_only_some_unknown_characters():
    tok = CharTokenizer.from_text("a")
    with pytest.raises(ValueError, match=r"12 character\(s\) not in this model's vocabulary: "
                                         r"the first 10, 'b', 'c', .*'k';"):
        tok.encode("abcdefghijklm")


def test_gpt2_tokenizer_round_trips_and_matches_known_ids():
    tok = GPT2Tokenizer()
    assert tok.vocab_size == 50257 and tok.eot_token == 50256
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids for these words
    text = TEXT + "naïve café, 東京 <|endoftext|>"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_prepared_bins_decode_back_to_the_source_text(tmp_path, kind):
    text = TEXT * 20
    meta = prepare_text(text, kind, tmp_path, source="test")
    assert load_meta(tmp_path) == meta
    tok = load_tokenizer(meta["tokenizer"])
    ids = np.concatenate([load_split(tmp_path, "train")[:], load_split(tmp_path, "val")[:]])
    assert ids.dtype == np.uint16
    assert tok.decode(ids.tolist()) == text
    assert meta["val_tokens"] == int(len(ids) * 0.1)


def test_get_batch_targets_are_inputs_shifted_by_one(char_data):
    data = load_split(char_data, "train")
    x, y = get_batch(data, block_size=16, batch_size=4, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a real window of the data
    flat = torch.from_numpy(data[:].astype(np.int64))
    for row_x, row_y in zip(x, y, strict=True):
        starts = [i for i in range(len(flat) - 16) if torch.equal(flat[i:i + 16], row_x)]
        assert any(torch.equal(flat[s + 1:s + 17], row_y) for s in starts)


def test_read_text_gives_a_file_exactly_and_joins_a_folder_in_name_order(tmp_path):
    (tmp_path / "c.txt").write_text("third, no final newline")
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "skip.md").write_text("not text\n")
    assert read_text(tmp_path / "c.txt") == "third, no final newline"
    assert read_text(tmp_path) == "first\n\nsecond\n\nthird, no final newline"


@pytest.mark.parametrize("content, message", [
    (b"", "holds no text"),
    (b"abc\n\xff\xfe", r"not valid UTF-8 \(byte offset 4, line 2\)"),
    (b"PK\x03\x04\x00\x00", "not text \\(NUL byte at offset 4\\)"),
])
def test_unusable_text_is_refused_with_the_reason(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_text(path)


def test_too_short_text_cannot_be_split(tmp_path):
    with pytest.raises(DataError, match="too few to split"):
        prepare_text("abc", "char", tmp_path, source="tiny")
    assert not (tmp_path / "meta.json").exists()


def test_builtin_corpus_is_identical_everywhere():
    # the 42 plays and poems in file-name order, because every machine must build the same bins
    text = shakespeare_text()
    assert len(text) == 5_057_321
    assert text.startswith("ALL'S WELL THAT ENDS WELL")
    assert sha256_bytes(text.encode()) == (
        "04decea0dd965df5e6cfc4a538b0c62623aaa3bfd848ac7fad6734e59c96624d")


@pytest.mark.parametrize("damage, message", [
    (lambda meta: "{not json", "meta.json is not valid JSON; prepare the dataset again"),
    (lambda meta: json.dumps({k: v for k, v in meta.items() if k != "dtype"}),
     "meta.json is damaged: it lacks dtype; prepare the dataset again"),
    (lambda meta: json.dumps({**meta, "dtype": "float64"}), "names an unknown dtype ('float64')"),
    (lambda meta: json.dumps({**meta, "tokenizer": {"kind": "sentencepiece"}}),
     "the tokenizer's description: its kind 'sentencepiece' is none of char, gpt2, bpe"),
    (lambda meta: json.dumps({**meta, "vocab_size": 3}), "the dataset's 3; prepare the dataset again"),
    (lambda meta: json.dumps({**meta, "shards": [{"file": 3}]}), "damaged shard list or split"),
    (lambda meta: json.dumps({**meta, "shards": [{**meta["shards"][0], "tokens": 10**9}]}),
     "tokens_000000.bin is missing or not 2000000000 bytes as meta.json says"),
])
def test_damaged_prepared_data_is_one_clear_error(tmp_path, char_data, damage, message):
    copy = tmp_path / "copy"
    shutil.copytree(char_data, copy)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(damage(meta))
    with pytest.raises(DataError, match=re.escape(message)):
        load_split(copy, "train", load_meta(copy))
