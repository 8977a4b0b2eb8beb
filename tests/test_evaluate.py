"""evaluate.py scores text as transformers' perplexity guide does, and its command line
writes what it prints and refuses what it cannot score."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from data.tokenizer import load_tokenizer
from measure.scores import check_batch_memory, check_stride, evaluate, windows
from tests.forked import python
from tests.output import error_line
from weights.checkpoint import load_checkpoint
from weights.loading import load_model

transformers = pytest.importorskip("transformers")  # test-only dependency
REPO = Path(__file__).resolve().parent.parent
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune, or to take arms against a sea of "
        "troubles, and by opposing end them? To die: to sleep; no more; and by a sleep to say "
        "we end the heart-ache and the thousand natural shocks that flesh is heir to, 'tis a "
        "consummation devoutly to be wish'd.")


def test_every_token_after_the_first_is_scored_exactly_once():
    for n, block, stride in [(10, 4, 2), (100, 32, 16), (33, 32, 31), (5, 8, 4), (2, 8, 4)]:
        scored = [t for _, end, first in windows(n, block, stride) for t in range(first, end)]
        assert scored == list(range(1, n))
        assert all(end - begin <= block for begin, end, _ in windows(n, block, stride))


def test_the_default_stride_is_half_the_block_and_a_block_of_one_is_refused():
    assert [check_stride(None, block) for block in (2, 3, 64)] == [1, 1, 32]
    with pytest.raises(ValueError, match="block_size 2 or more"):
        check_stride(None, 1)  # a bigram model, whose one-token window leaves nothing to score


def test_a_batch_whose_logits_cannot_fit_in_memory_is_refused():
    cpu = torch.device("cpu")
    check_batch_memory(2, 512, 50257, cpu)  # GPT-2's default batch, which needs 206 MB
    with pytest.raises(ValueError, match=r"a batch of 1,000,000 windows needs at least "
                                         r"102,926\.3 GB \(102,926\.3 for its logits\), but "
                                         r"cpu has [\d,.]+ GB free"):
        check_batch_memory(10**6, 512, 50257, cpu)


def transformers_loss(model, ids: list[int], block: int, stride: int) -> float:
    """The sliding-window loop of transformers' perplexity guide: tokens that an earlier
    window scored get the label -100, and the model shifts the labels by one itself."""
    nll, count, scored_to = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + block, len(ids))
        inputs = torch.tensor([ids[begin:end]])
        labels = inputs.clone()
        labels[:, :-(end - scored_to)] = -100
        with torch.no_grad():
            loss = model(inputs, labels=labels).loss.item()
        n = (labels[:, 1:] != -100).sum().item()
        nll, count, scored_to = nll + loss * n, count + n, end
        if end == len(ids):
            break
    return nll / count


@pytest.mark.parametrize("words", [12, 400])  # shorter than one window, and several windows
def test_loss_equals_transformers_with_the_same_windows(tmp_path, words):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)).eval()
    hf.save_pretrained(tmp_path)
    model, tokenizer, _ = load_model(init_from=str(tmp_path))
    text = " ".join((TEXT.split() * 4)[:words])
    ids = tokenizer.encode(text)
    assert (len(ids) < 32) == (words == 12)
    scores = evaluate(model, tokenizer, text, batch_size=3)
    assert scores.tokens == len(ids) - 1
    assert abs(scores.loss - transformers_loss(hf, ids, 32, 16)) < 1e-4
    assert scores.perplexity == pytest.approx(math.exp(scores.loss))
    first = len(tokenizer.decode(ids[:1]))
    assert scores.bits_per_char == pytest.approx(
        scores.loss * scores.tokens / math.log(2) / (len(text) - first))


def run_evaluate(*args: str) -> subprocess.CompletedProcess:
    return python(["evaluate.py", *args], timeout=120)


def test_cli_writes_the_scores_it_prints_and_int8_costs_little(trained_run, corpus_file,
                                                                tmp_path):
    ckpt = load_checkpoint(trained_run / "best.pt")
    text = corpus_file.read_text()[:5000].rstrip("\n")  # with no final newline, scored as it is
    (tmp_path / "part.txt").write_text(text)
    scores = {}
    for dtype in ("float32", "int8"):
        out = tmp_path / f"{dtype}.json"
        result = run_evaluate("--input", str(tmp_path / "part.txt"), "--run", str(trained_run),
                              "--dtype", dtype, "--json", str(out))
        assert result.returncode == 0, result.stderr
        scores[dtype] = json.loads(out.read_text())
        assert f"loss {scores[dtype]['loss']:.4f} nats/token" in result.stdout
    fp32 = scores["float32"]
    assert fp32["tokens"] == fp32["chars"] == len(text) - 1  # characters are the tokens
    assert fp32["bits_per_char"] == pytest.approx(fp32["loss"] / math.log(2))
    assert fp32["perplexity"] == pytest.approx(math.exp(fp32["loss"]))
    # the same numbers in-process, and int8 comes close
    model, _, _ = load_model(checkpoint=str(trained_run / "best.pt"))
    in_process = evaluate(model, load_tokenizer(ckpt["tokenizer"]), text)
    assert in_process.loss == pytest.approx(fp32["loss"], abs=1e-5)
    assert abs(scores["int8"]["loss"] - fp32["loss"]) < 0.02


GOOD = {"ctx": "ROMEO: Nurse sees", "endings": ["the moon.", "moon the."], "label": "0"}
LONG_CHOICE = "the moon " * 4  # 36 characters, so 37 tokens for a char model once its leading space is added


@pytest.mark.parametrize("second, problem", [
    (json.dumps({**GOOD, "label": "²"}).encode(), "the answer the index of one of them"),
    (b'{"ctx": "caf\xe9", "endings": ["a", "b"], "label": 0}', "is not valid UTF-8 (byte 13 "
                                                             "of the line)"),
    (b'{"ctx": "ROMEO", "endings": ["a", "b"], "label": 0', "is not valid JSON"),
    (b'{"ctx": "ROMEO", "ctx": "JULIET", "endings": ["a", "b"], "label": 0}',
     "gives the key 'ctx' twice; keep one"),
    (b'{"context": "ROMEO", "choices": ["a"], "answer": 0}', "two or more texts"),
    (b'{"context": "ROMEO", "choices": ["a", "b"], "answer": 1.0}', "the index of one"),
    (b'{"context": "ROMEO", "choices": "ab", "answer": 0}', "two or more texts"),
    (b'{"context": "ROMEO", "choices": ["a", ""], "answer": 0}', "two or more texts"),
    (b'{"context": "ROMEO", "choices": ["a", "b"], "answer": true}', "the index of one"),
    (b'{"context": "ROMEO", "choices": ["a", "b"], "answer": 2}', "the index of one"),
    (b'{"context": "ROMEO", "choices": ["a", "b"]}', "give ctx, endings and label"),
    (b'["ROMEO", ["a", "b"], 0]', "give ctx, endings and label"),
    (b'{"context": "ROMEO", "choices": ["a", "b"], "answer": ' + b"9" * 5000 + b"}",
     "is not JSON that can be read (Exceeds the limit"),
    (b"[" * 100_000 + b"]" * 100_000, "nests its JSON deeper than it can be read"),
    (b'{"context": "", "choices": ["a", "b"], "answer": 0}',
     "the context is empty, and this tokenizer has no start token to stand for it"),
    (b'{"context": "ROMEO", "choices": ["a", "~^"], "answer": 0}',
     "2 character(s) not in this model's vocabulary"),
    (b'{"context": "ROMEO \\ud83d", "choices": ["a", "b"], "answer": 0}',
     "holds half a character (\\ud83d"),
    (json.dumps({**GOOD, "endings": ["the moon.", LONG_CHOICE]}).encode(),
     "choice 1 is 37 tokens, more than the model's context of 32, so it cannot be scored "
     "(lm-eval refuses it too)"),
])
def test_a_bad_task_line_is_one_line_naming_it_and_nothing_written(trained_run, tmp_path, second,
                                                                  problem):
    task = tmp_path / "task.jsonl"
    task.write_bytes(json.dumps(GOOD).encode() + b"\n" + second + b"\n")
    result = run_evaluate("--task", str(task), "--run", str(trained_run), "--json",
                          str(tmp_path / "scores.json"))
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(f"error: {task} line 2")
    assert problem in error_line(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task.jsonl"]


@pytest.mark.parametrize("contents", [b"", b"\n  \r\n", b"\xef\xbb\xbf"])
def test_a_task_without_items_is_one_line(trained_run, tmp_path, contents):
    task = tmp_path / "task.jsonl"
    task.write_bytes(contents)
    result = run_evaluate("--task", str(task), "--run", str(trained_run))
    assert result.returncode == 1
    assert error_line(result.stderr) == (f"error: {task} holds no items; write one JSON object "
                                         f"per line")


def test_a_task_from_windows_scores_as_the_same_task_from_linux(trained_run, tmp_path):
    # a byte-order mark and CRLF line ends, as Windows editors write them, and a choice that
    # fills the model's whole context, which is scored as lm-eval scores it, with one token of
    # context before it
    items = [GOOD, {**GOOD, "endings": ["the moon.", LONG_CHOICE[:31]], "label": 1}]
    text = "".join(json.dumps(item) + "\n" for item in items)
    scores = []
    for name, data in (("linux", text.encode()),
                       ("windows", b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())):
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        out = tmp_path / f"{name}.json"
        result = run_evaluate("--task", str(tmp_path / f"{name}.jsonl"), "--run",
                              str(trained_run), "--json", str(out))
        assert result.returncode == 0, result.stderr
        scores.append({k: v for k, v in json.loads(out.read_text()).items() if k != "task"})
    assert scores[0] == scores[1] and scores[0]["items"] == 2


def test_a_task_of_one_item_has_no_standard_error_and_writes_strict_json(trained_run, tmp_path):
    task, out = tmp_path / "one.jsonl", tmp_path / "one.json"
    task.write_text(json.dumps(GOOD) + "\n")
    result = run_evaluate("--task", str(task), "--run", str(trained_run), "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "acc_norm" in result.stdout and result.stdout.count("± n/a") == 2
    assert "nan" not in result.stdout

    def refuse(constant: str) -> None:  # NaN and Infinity are Python's, not JSON's
        raise AssertionError(f"{out} holds {constant}")
    record = json.loads(out.read_text(), parse_constant=refuse)
    assert record["items"] == 1 and record["acc_stderr"] is None
    assert record["acc"] in (0.0, 1.0)


@pytest.mark.parametrize("contents, problem", [
    (b'{"messages": [{"role": "user", "content": "ROMEO"}]}\n',
     "line 1: the conversation ends without an assistant turn"),
    (b'{"messages": []}\n', "line 1: its messages are not a non-empty list; fix or remove"),
    (b'\n{"messages": "ROMEO"\n', "line 2 is not valid JSON"),
    (b"", "holds no conversations"),
])
def test_a_bad_conversations_file_is_one_line_naming_its_line(trained_run, tmp_path, contents,
                                                              problem):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(contents)
    result = run_evaluate("--answers", str(path), "--run", str(trained_run))
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(f"error: {path}")
    assert problem in error_line(result.stderr)
