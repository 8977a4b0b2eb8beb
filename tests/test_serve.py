"""serve.py: the real server on 127.0.0.1, in its own process, driven by the real `openai`
client, raw HTTP and a real browser. Its answers equal sample.py's (--prompt and --chat), a
streamed answer equals the same answer whole, 16 requests at once equal the same 16 one by
one, and every bad request gets a 4xx in OpenAI's error shape."""

import asyncio
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from data.bpe_tokenizers import GPT2Tokenizer
from data.chat import with_specials
from data.specials import CHAT_SPECIALS
from data.tokenizer import CharTokenizer, load_tokenizer
from model import GPT, GPTConfig
from serving.app import METRICS, prometheus
from tests.forked import python
from tests.output import error_line
from weights.checkpoint import load_checkpoint, save_checkpoint

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parent.parent


class Server:
    """A serve.py process and where it listens."""

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process, self.url = process, url

    def client(self, api_key: str = "none") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def request(self, method: str, path: str, body: object = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], dict]:
        """Raw HTTP: the status, the headers and the JSON body. A body that is neither text
        nor bytes is sent in chunks, without a Content-Length."""
        host, port = self.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers or {},
                               encode_chunked=not isinstance(body, str | bytes | None))
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), json.loads(response.read())
        finally:
            connection.close()

    def health(self) -> dict:
        return self.request("GET", "/health")[2]


@contextmanager
def serving(*args: str) -> Iterator[Server]:
    """serve.py on a port the system picks (--port 0), read back from its first line."""
    # one thread each: the suite runs beside other tests (xdist), which time their own work
    process = subprocess.Popen([sys.executable, "serve.py", "--port", "0", *args], cwd=REPO,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []  # notes may come first (a C step built without some flags)
        while (line := process.stderr.readline()) and not line.startswith("serving "):
            lines.append(line)
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/", line)
        assert found, "".join(lines) + line + process.stderr.read()
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keep it drained
        yield Server(process, found.group(1))
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture(scope="module")
def chat_server(sft_run) -> Iterator[Server]:
    with serving("--run", str(sft_run[0])) as server:
        yield server


@pytest.fixture(scope="module")
def slow_run(trained_run, tmp_path_factory) -> Path:
    """A checkpoint of random weights with the tiny run's tokenizer, wide and with a long
    context, so that one answer of 600 tokens takes seconds: long enough to catch in flight."""
    ckpt = load_checkpoint(trained_run / "best.pt")
    torch.manual_seed(0)
    shape = {**ckpt["model_args"], "block_size": 1024, "n_layer": 4, "n_head": 8, "n_embd": 512}
    ckpt["model_args"], ckpt["model"] = shape, GPT(GPTConfig(**shape)).state_dict()
    path = tmp_path_factory.mktemp("slow") / "slow.pt"
    save_checkpoint(ckpt, path)
    return path


@pytest.fixture(scope="module")
def gpt2_server(trained_run, tmp_path_factory) -> Iterator[Server]:
    """A tiny model of random weights with GPT-2's tokenizer and the chat tokens: its
    tiktoken writes a lone surrogate as U+FFFD, where a character table refuses it."""
    ckpt = load_checkpoint(trained_run / "best.pt")
    meta = with_specials(GPT2Tokenizer().to_meta(), CHAT_SPECIALS)
    torch.manual_seed(0)
    shape = {**ckpt["model_args"], "vocab_size": meta["vocab_size"], "block_size": 64,
             "n_layer": 1, "n_head": 2, "n_embd": 32}
    ckpt["model_args"], ckpt["model"] = shape, GPT(GPTConfig(**shape)).state_dict()
    ckpt["tokenizer"] = meta
    path = tmp_path_factory.mktemp("gpt2") / "bpe.pt"
    save_checkpoint(ckpt, path)
    with serving("--checkpoint", str(path)) as server:
        yield server


CHAIN_TEXT = "你好世界"  # four characters of two byte-level tokens each, every one U+FFFD alone
CHAIN_KEY = "k3y"
# a model is named after its file: this name needs escaping in /metrics' label values
CHAIN_NAME = 'chain "x\\y'


def byte_chain_checkpoint(trained_run: Path, path: Path) -> list[int]:
    """A model, in GPT-2's tokenizer with the chat tokens, whose greedy answer after
    <|assistant_start|> is CHAIN_TEXT: its blocks add nothing, so each position's logits come
    from its own token alone, and each chain token's embedding points the head at the next.
    The bytes 0x80 to 0x93, each a token that reads U+FFFD, come next everywhere in the chain,
    in that order. Saved at `path`; returns the chain's ids, <|assistant_start|> first."""
    ckpt = load_checkpoint(trained_run / "best.pt")
    meta = with_specials(GPT2Tokenizer().to_meta(), CHAT_SPECIALS)
    tokenizer = load_tokenizer(meta)
    chain = [tokenizer.specials["<|assistant_start|>"], *tokenizer.encode(CHAIN_TEXT)]
    shape = {**ckpt["model_args"], "vocab_size": meta["vocab_size"], "block_size": 64,
             "n_layer": 1, "n_head": 2, "n_embd": 32, "bias": False, "pos_embedding": "none",
             "norm": "rmsnorm", "tie_embeddings": False}
    weights = {k: torch.zeros_like(v) for k, v in GPT(GPTConfig(**shape)).state_dict().items()}
    scale = 1 / math.sqrt(shape["n_embd"])  # RMSNorm makes a one-hot vector sqrt(n_embd) long
    for i, token in enumerate(chain):
        weights["transformer.wte.weight"][token, i] = 1.0
        if i + 1 < len(chain):
            weights["lm_head.weight"][chain[i + 1], i] += 30 * scale
    for j, byte in enumerate(range(0x80, 0x94)):
        weights["lm_head.weight"][tokenizer.ranks[bytes([byte])], :len(chain)] += (20 - j / 2) * scale
    ckpt["model_args"], ckpt["model"], ckpt["tokenizer"] = shape, weights, meta
    save_checkpoint(ckpt, path)
    return chain


CHAT = [{"role": "user", "content": "ROMEO"}]


def test_a_streamed_answer_equals_the_whole_one(chat_server):
    client = chat_server.client()
    settings = dict(model="chat_sft", temperature=0.9, seed=3, max_tokens=20)
    whole = client.chat.completions.create(messages=CHAT, **settings)
    pieces = list(client.chat.completions.create(messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **settings))
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content and text
    assert pieces[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert pieces[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == 9  # <|bos|><|user_start|>ROMEO<|user_end|><|assistant_start|>
    complete = dict(model="chat_sft", prompt="JULIET: ", max_tokens=12, temperature=0.0)
    whole = client.completions.create(**complete)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **complete))
    assert streamed == whole.choices[0].text and whole.choices[0].finish_reason == "length"


def sample_py(*args: str, stdin: str | None = None) -> str:
    result = python(["sample.py", *args], input=stdin)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_completions_equal_sample_py_prompt(chat_server, sft_run):
    """The same prompt, sampling and seed: the same text, up to the same stop string."""
    settings = ["--temperature", "0.9", "--top-k", "12", "--seed", "11", "--max-new-tokens", "20"]
    printed = sample_py("--run", str(sft_run[0]), "--prompt", "ROMEO:", "--stop", "e",
                        *settings)
    answer = chat_server.client().completions.create(
        model="chat_sft", prompt="ROMEO:", temperature=0.9, seed=11, max_tokens=20, stop="e",
        extra_body={"top_k": 12})
    assert printed == "ROMEO:" + answer.choices[0].text + "\n"


def test_chat_equals_sample_py_chat_on_the_same_history(chat_server, sft_run):
    """The REPL's two replies; the server, given the first turn and then the history with
    the REPL's first reply, answers both alike. Neither names max_tokens: both take the
    default, capped by the room left in the context (here 32 tokens: two short turns)."""
    replies = sample_py("--run", str(sft_run[0]), "--chat", "--temperature", "0",
                        stdin="ROMEO\nNURSE\n").splitlines()
    client, history = chat_server.client(), []
    for user, reply in zip(["ROMEO", "NURSE"], replies, strict=True):
        history.append({"role": "user", "content": user})
        answer = client.chat.completions.create(model="chat_sft", messages=history, temperature=0)
        assert answer.choices[0].message.content == reply
        history.append({"role": "assistant", "content": reply})
    assert replies[0] == "Romeo loves."  # what the fine-tuning taught
    # sampled, with a seed: the first turn's reply, drawn as the REPL draws it
    seeded = sample_py("--run", str(sft_run[0]), "--chat", "--temperature", "1.5", "--seed",
                       "5", "--max-new-tokens", "20", stdin="JULIET\n")
    answer = client.chat.completions.create(model="chat_sft", messages=[
        {"role": "user", "content": "JULIET"}], temperature=1.5, seed=5, max_tokens=20)
    assert answer.choices[0].message.content + "\n" == seeded


def test_sixteen_requests_at_once_equal_the_same_sixteen_one_by_one(chat_server):
    names = ["ROMEO", "JULIET", "NURSE", "TYBALT"]
    prompts = [f"{names[i % 4]}: {names[i // 4].title()} " for i in range(16)]
    requests = [dict(model="chat_sft", prompt=p, max_tokens=2 + i, temperature=0.8, seed=i)
                for i, p in enumerate(prompts)]
    client = chat_server.client()
    alone = [client.completions.create(**r).choices[0].text for r in requests]
    together: list[str | None] = [None] * 16

    def send(i: int) -> None:
        together[i] = client.completions.create(**requests[i]).choices[0].text

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert together == alone
    assert chat_server.health()["widest_step"] > 1  # they did decode side by side


def test_the_models_own_step_serves_a_batch_too(sft_run):
    """--decode eager (the model's forward, a GPU's step): every slot steps together, and
    four answers at once equal the same four one by one."""
    with serving("--run", str(sft_run[0]), "--decode", "eager", "--parallel", "4") as server:
        client = server.client()
        requests = [dict(model="chat_sft", prompt=name, max_tokens=12, temperature=0.0)
                    for name in ("ROMEO:", "JULIET: ", "NURSE", "TYBALT: Romeo")]
        alone = [client.completions.create(**r).choices[0].text for r in requests]
        together: list[str | None] = [None] * 4
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(
            i, client.completions.create(**requests[i]).choices[0].text)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert together == alone and all(alone)


BAD = [  # (endpoint, body, status, words of the message, param)
    ("chat", "{not json", 400, "not valid JSON", None),
    ("chat", {"model": "chat_sft"}, 400, "messages", "messages"),
    ("chat", {"messages": "hi"}, 400, "messages", "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "unknown role", "messages"),
    ("chat", {"messages": CHAT, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("chat", {"messages": CHAT, "temperature": 7}, 400, "temperature", "temperature"),
    ("chat", {"messages": CHAT, "top_p": 0}, 400, "top_p", "top_p"),
    ("chat", {"messages": CHAT, "n": 2}, 400, "n: this server returns one choice", "n"),
    ("chat", {"messages": CHAT, "stop": ""}, 400, "empty string", "stop"),
    ("chat", {"messages": CHAT, "stop": [str(i) for i in range(17)]}, 400, "at most 16", "stop"),
    ("chat", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": 30}, 400, "context of 32 tokens", "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "ROMEO " * 9}]}, 400, "context holds 32",
     "messages"),
    ("chat", {"messages": CHAT, "model": "gpt-4"}, 404, "not served here", "model"),
    ("completions", {"prompt": "Ω"}, 400, "prompt", "prompt"),
    ("completions", {"prompt": [[3, 99999]]}, 400, "token id 99999 is outside the vocabulary",
     "prompt"),
    ("completions", {"prompt": []}, 400, "empty list", "prompt"),
    # token ids are integers: neither booleans (true was token 1) nor floats nor strings
    ("completions", {"prompt": [True, False, 5]}, 400, "token ids (integers) or a list of lists "
     "of token ids; prompt[0] is true", "prompt"),
    ("completions", {"prompt": [[5, 1.0]]}, 400, "prompt[0][1] is 1.0", "prompt"),
    ("completions", {"prompt": ["ROMEO", 5]}, 400, "prompt[1] is 5", "prompt"),
    ("completions", {"prompt": [-1]}, 400, "token id -1 is outside the vocabulary", "prompt"),
    ("completions", {"prompt": [10**30]}, 400, f"token id {10**30} is outside", "prompt"),
    ("detokenize", {"tokens": [True, False]}, 400,
     "tokens[0]: Input should be a valid integer, not true", "tokens"),
    ("detokenize", {"tokens": [5.0]}, 400, "tokens[0]: Input should be a valid integer, not 5.0",
     "tokens"),
    ("detokenize", {"tokens": [[5]]}, 400, "not [5]", "tokens"),
    ("detokenize", {"tokens": [5, 99999]}, 400, "token id 99999 is outside the vocabulary of 43; "
     "send ids from 0 to 42", "tokens"),
    # and so is every count, and a switch is a boolean
    ("completions", {"prompt": "ROMEO", "max_tokens": True}, 400,
     "max_tokens: Input should be a valid integer, not true", "max_tokens"),
    ("completions", {"prompt": "ROMEO", "logprobs": True}, 400, "logprobs: Input should be a "
     "valid integer, not true", "logprobs"),
    ("completions", {"prompt": "ROMEO", "max_tokens": 2.0}, 400, "not 2.0", "max_tokens"),
    ("chat", {"messages": CHAT, "stream": "yes"}, 400, 'stream: Input should be a valid boolean, '
     'not "yes"', "stream"),
    ("chat", {"messages": CHAT, "stream_options": {"include_usage": "no"}}, 400,
     'stream_options.include_usage: Input should be a valid boolean, not "no"', "stream_options"),
    # a count is an integer, as every other count is
    ("chat", {"messages": CHAT, "n": True}, 400, "n: Input should be a valid integer, not true",
     "n"),
    ("chat", {"messages": CHAT, "n": 1.0}, 400, "n: Input should be a valid integer, not 1.0",
     "n"),
    ("completions", {"prompt": "ROMEO", "best_of": 1.0}, 400,
     "best_of: Input should be a valid integer, not 1.0", "best_of"),
    ("chat", '{"messages": [], "temperature": NaN}', 400, "temperature: NaN is not JSON "
     "(RFC 8259 has no NaN or Infinity); send a finite number", "temperature"),
    ("chat", {"messages": CHAT, "stop": [None]}, 400,
     "stop[0]: Input should be a valid string, not null", "stop"),
    # more prompts than the slots and the queue hold could never be taken: not a 429
    ("completions", {"prompt": ["ROMEO"] * 81}, 400,
     "prompt holds 81 prompts, and this server takes at most 80 at once", "prompt"),
    # a body that is not a JSON object, on every route
    ("chat", "[1, 2]", 400, "the body is [1, 2], not a JSON object", None),
    ("completions", "", 400, "the body is empty, not a JSON object", None),
    ("tokenize", b'{"prompt": "\xff"}', 400, "the body is not UTF-8 text", None),
    ("detokenize", '{"tokens": ' + "[" * 10**5 + "]" * 10**5 + "}", 400, "nests lists or "
     "objects too deeply", None),
    ("tokenize", {"prompt": 5}, 400, "prompt: Input should be a valid string, not 5", "prompt"),
    ("completions", {"prompt": "ROMEO", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("completions", {"prompt": "ROMEO", "max_tokens": 0}, 400, "echo", None),
    ("completions", {"prompt": "ROMEO " * 9, "echo": True, "max_tokens": 0, "logprobs": 1}, 400,
     "takes 54 tokens, and an echo scores at most 33 (the model's context of 32, and the token "
     "after it)", "prompt"),
    ("chat", {"messages": CHAT, "top_logprobs": 2}, 400, "logprobs: true", None),
    ("nothing", {}, 404, "not an endpoint", None),
]


@pytest.mark.parametrize("endpoint, body, status, words, param", BAD)
def test_a_bad_request_gets_a_4xx_in_openais_shape(chat_server, endpoint, body, status, words,
                                                   param):
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
            "tokenize": "/tokenize", "detokenize": "/detokenize"}.get(endpoint, "/v1/x")
    code, _, answer = chat_server.request("POST", path, content,
                                          {"content-type": "application/json"})
    assert code == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and error["param"] == param


def test_a_body_not_sent_as_json_is_told_to_say_so(chat_server):
    # curl -d sends its body as a form, which FastAPI passes on as bytes, unparsed
    code, _, answer = chat_server.request("POST", "/v1/completions", '{"prompt": "ROMEO"}', {
        "content-type": "application/x-www-form-urlencoded"})
    assert code == 400 and answer["error"]["message"] == (
        "the body is not marked as JSON; send a JSON object with Content-Type: application/json")


def chat_body(rest: str) -> str:
    """A chat request's JSON text, with `rest` (JSON text) after its messages and max_tokens."""
    return '{"messages": [{"role": "user", "content": "ROMEO"}], "max_tokens": 2, ' + rest + "}"


@pytest.mark.parametrize("path, body, words, param", [
    # NaN and Infinity are not JSON, in a field that the server ignores as in one it reads
    ("/v1/chat/completions", chat_body('"user": NaN'), "user: NaN is not JSON", "user"),
    ("/v1/chat/completions", chat_body('"metadata": {"a": [1, Infinity]}'),
     "metadata.a[1]: Infinity is not JSON", "metadata"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ROMEO", "name": '
     '-Infinity}], "max_tokens": 2}', "messages[0].name: -Infinity is not JSON", "messages"),
    ("/v1/chat/completions", chat_body('"stream": true, "stream_options": {"include_usage": '
                                       'true, "continuous_usage_stats": NaN}'),
     "stream_options.continuous_usage_stats: NaN is not JSON (RFC 8259 has no NaN or Infinity); "
     "send a finite number", "stream_options"),
    ("/tokenize", '{"prompt": "ROMEO", "extra": NaN}', "extra: NaN is not JSON", "extra"),
    ("/detokenize", '{"tokens": [5], "extra": [1e999]}', "extra[0]: 1e999 is past the range "
     "of a float; send a finite number", "extra"),
    ("/v1/completions", '{"prompt": "ROMEO", "user": %s}' % ("9" * 5000), "the body holds an "
     "integer longer than this server reads (past 4,300 digits)", None),
    ("/v1/completions", "NaN", "the body is NaN, not JSON", None),
    ("/v1/completions", "1e999", "the body is 1e999, past the range of a float", None),
    ("/v1/completions", '\ufeff{"prompt": "ROMEO"}'.encode(), "starts with a byte-order mark",
     None),
    # a key given twice was answered with its last value
    ("/v1/completions", '{"prompt": "ROMEO", "prompt": "JULIET", "max_tokens": 2}',
     "prompt is given twice; send each key once", "prompt"),
    ("/v1/completions", '{"prompt": "ROMEO", "max_tokens": 2, "max_tokens": 3}',
     "max_tokens is given twice", "max_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "role": "assistant", "content": '
     '"ROMEO"}], "max_tokens": 2}', "messages[0].role is given twice", "messages"),
    ("/v1/chat/completions", chat_body('"stream": true, "stream": false'),
     "stream is given twice", "stream"),
    ("/tokenize", '{"prompt": "a", "x": {"y": 1, "y": 2}}', "x.y is given twice", "x"),
])
def test_a_body_that_is_not_strict_json_is_refused_naming_the_place(chat_server, path, body,
                                                                    words, param):
    code, _, answer = chat_server.request("POST", path, body, {"content-type": "application/json"})
    assert code == 400 and words in answer["error"]["message"], answer
    assert answer["error"]["param"] == param


def test_free_form_fields_with_json_values_are_still_answered(chat_server):
    client = chat_server.client()
    answer = client.chat.completions.create(
        model="chat_sft", messages=[{"role": "user", "content": "ROMEO", "name": "r"}],
        max_tokens=2, n=1, user="u", metadata={"a": "b"}, stream=False,
        extra_body={"extra": [1.5, {"x": 1}]})
    assert answer.choices[0].finish_reason in ("stop", "length")
    for path, body in [("/tokenize", '{"prompt": "ROMEO", "extra": 1.5}'),
                       ("/detokenize", '{"tokens": [5], "extra": {"a": 1, "b": 1}}')]:
        code, _, reply = chat_server.request("POST", path, body,
                                             {"content-type": "application/json"})
        assert code == 200, reply


HALF = "half \ud800 a character"  # JSON's "\ud800": a surrogate without its pair


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": HALF}, "prompt"),
    ("/v1/completions", {"prompt": [HALF]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HALF}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "a"}, {
        "role": "user", "content": [{"type": "text", "text": HALF}]}]}, "messages"),
    ("/v1/completions", {"prompt": "hi", "stop": HALF}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["x", HALF]}, "stop"),
    ("/tokenize", {"prompt": HALF}, "prompt"),
])
def test_text_that_is_not_text_is_refused_alike_by_every_route(gpt2_server, path, body, param):
    """A prompt was answered as if it held U+FFFD, while chat refused the same text: now
    every route refuses it with a 400 naming the field (data.text.check_text)."""
    code, _, answer = gpt2_server.request("POST", path, json.dumps({**body, "max_tokens": 2}),
                                          {"content-type": "application/json"})
    assert code == 400 and answer["error"]["param"] == param, answer
    assert "holds half a character (\\ud800 at character 5" in answer["error"]["message"]
    # the replacement character itself is text, and answered
    good = json.loads(json.dumps(body).replace("\\ud800", "\\ufffd"))
    code, _, answer = gpt2_server.request("POST", path, json.dumps({**good, "max_tokens": 2}),
                                          {"content-type": "application/json"})
    assert code == 200, answer


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}}}),
    ("tools", [{"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}]),
    ("tool_choice", "required"),
    ("functions", [{"name": "now", "parameters": {"type": "object", "properties": {}}}]),
    ("function_call", {"name": "now"}),
    ("frequency_penalty", 0.5),
    ("presence_penalty", -1.0),
    ("logit_bias", {"5": 10}),
])
def test_a_field_the_server_cannot_honour_is_refused_by_name(chat_server, field, value):
    """Text that is not JSON answered a request for JSON; tools were ignored. The real
    openai client raises BadRequestError naming the field."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat_server.client().chat.completions.create(model="chat_sft", messages=CHAT,
                                                     max_tokens=2, **{field: value})
    assert refused.value.param == field and field in refused.value.message


def test_values_that_ask_for_nothing_are_answered(chat_server):
    client, settings = chat_server.client(), dict(model="chat_sft", messages=CHAT, temperature=0)
    plain = client.chat.completions.create(**settings)
    same = client.chat.completions.create(**settings, response_format={"type": "text"},
                                          tools=[], tool_choice="none", frequency_penalty=0,
                                          presence_penalty=0, logit_bias={}, n=1)
    assert same.choices[0].message.content == plain.choices[0].message.content == "Romeo loves."


def test_text_parts_and_the_developer_role_are_read_as_openai_clients_mean_them(chat_server):
    """Content as a list of text parts (the openai client's, LangChain's and most UIs')
    is the parts joined by newlines; "developer" is "system"; an image is refused by part."""
    client, settings = chat_server.client(), dict(model="chat_sft", temperature=0, max_tokens=8)
    plain = client.chat.completions.create(messages=[
        {"role": "system", "content": "Be."}, {"role": "user", "content": "ROMEO\nNURSE"}],
        **settings)
    parts = client.chat.completions.create(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be."}]},
        {"role": "user", "content": [{"type": "text", "text": "ROMEO"},
                                     {"type": "text", "text": "NURSE"}]}], **settings)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens == 4 + len("Be.\n\nROMEO\nNURSE")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "text", "text": "ROMEO"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
            **settings)
    assert refused.value.param == "messages"
    assert "message 1's content part 2 is of type 'image_url', not text" in refused.value.message


@pytest.mark.parametrize("edge", [
    {"top_p": 1e-300}, {"top_p": 5e-324}, {"top_p": 1e-46}, {"top_k": 1},
    {"temperature": 5e-324}, {"temperature": 1e-300, "top_k": 10**12, "top_p": 5e-324},
])
def test_every_sampling_filter_at_its_edge_answers_the_likeliest_tokens(chat_server, edge):
    """top_p 1e-300 was a 503 (a stream: an error event) with "probability tensor contains
    inf/nan" in the log: every filter keeps the likeliest token, so each edge answers what
    temperature 0 answers, whole and streamed."""
    client = chat_server.client()
    settings = dict(model="chat_sft", prompt="ROMEO:", max_tokens=12, seed=1)
    greedy = client.completions.create(**settings, temperature=0).choices[0].text
    sampled = {"temperature": 1.5, **edge}
    whole = client.completions.create(**settings, extra_body=sampled)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **settings, stream=True, extra_body=sampled))
    assert whole.choices[0].text == streamed == greedy


def test_completions_leave_special_tokens_out_of_text_unless_asked(chat_server, sft_run):
    """A chat model continuing a prompt ends its replies with <|assistant_end|>, which
    text leaves out unless skip_special_tokens is false (vLLM's field and default)."""
    client = chat_server.client()
    settings = dict(model="chat_sft", prompt="Romeo loves.", max_tokens=20, temperature=0)
    kept = client.completions.create(**settings, extra_body={"skip_special_tokens": False})
    left_out = client.completions.create(**settings)
    assert "<|assistant_end|>" in kept.choices[0].text
    assert left_out.choices[0].text == kept.choices[0].text.replace("<|assistant_end|>", "")
    assert left_out.usage.completion_tokens == kept.usage.completion_tokens == 20
    streamed = "".join(c.choices[0].text for c in client.completions.create(**settings, stream=True))
    assert streamed == left_out.choices[0].text
    assert "Romeo loves." + left_out.choices[0].text + "\n" == sample_py(
        "--run", str(sft_run[0]), "--prompt", "Romeo loves.", "--temperature", "0",
        "--max-new-tokens", "20")


def test_a_body_over_a_megabyte_gets_413(chat_server):
    big = json.dumps({"prompt": "a" * (1 << 20)})
    code, _, answer = chat_server.request("POST", "/v1/completions", big)
    assert code == 413 and "over 1 MB" in answer["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 65536
    assert chat_server.request("POST", "/v1/completions", chunks())[0] == 413
    assert chat_server.health()["status"] == "ok"


def test_the_key_the_queue_a_hang_up_and_sigterm(slow_run):
    """With --api-key, one slot and no queue: a missing or wrong key gets 401; a request
    while the slot is busy gets 429 with Retry-After; a client that hangs up mid-answer
    frees the slot long before the answer would have ended; SIGTERM lets the running answer
    finish and exits 0."""
    with serving("--checkpoint", str(slow_run), "--api-key", "k3y", "--parallel", "1",
                 "--queue", "0") as server:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        assert server.request("GET", "/v1/models")[0] == 401
        client = server.client("k3y")
        assert [m.id for m in client.models.list()] == ["slow"]
        long = dict(model="slow", prompt="ROMEO:", max_tokens=600, temperature=1.0, seed=0)
        with client.completions.create(stream=True, **long) as stream:
            next(iter(stream))  # its first piece has come: the slot is taken
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model="slow", prompt="JULIET:", max_tokens=4)
            assert refused.value.response.headers["retry-after"] == "1"
        # the stream was closed after one piece: the engine drops it within a step
        for _ in range(100):
            if server.health()["active"] == 0:
                break
            time.sleep(0.05)
        assert server.health()["tokens"] < 600
        answers: list[str] = []
        short = {**long, "max_tokens": 150}  # a second or so: within the grace of 5 s
        reader = threading.Thread(target=lambda: answers.append(
            "".join(c.choices[0].text for c in client.completions.create(stream=True, **short))))
        reader.start()
        for _ in range(200):  # until it runs
            if server.health()["active"] == 1:
                break
            time.sleep(0.05)
        os.kill(server.process.pid, signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        reader.join(timeout=30)
        assert len(answers) == 1 and answers[0]  # it finished, whole
        with pytest.raises(ConnectionRefusedError):  # and nothing listens any more
            server.health()


def test_the_servers_connections_send_at_once():
    # as uvicorn serves serve.listen's socket: Nagle's algorithm left on held each reply's body
    # back until the client acked its headers, 40 ms later on a kept-alive connection
    from serve import listen

    async def nodelay_of_a_connection() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=listen("127.0.0.1", 0))
        async with server:
            _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            result = await asyncio.wait_for(accepted, 10)
            writer.close()
            return result

    assert asyncio.run(nodelay_of_a_connection()) == 1


def hang_up(server: Server, n: int, body: dict, after: float, key: str | None = None) -> None:
    """n requests for /v1/completions on real sockets, each closed `after` seconds later
    without reading a byte of the answer, as a client that gives up does."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(payload)}\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n").encode()
    sockets = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    for s in sockets:
        s.sendall(head + payload)
    time.sleep(after)
    for s in sockets:
        s.close()


@pytest.mark.parametrize("streamed, key", [(False, None), (False, "k3y"), (True, None)])
def test_clients_that_hang_up_are_cancelled_running_or_queued(slow_run, streamed, key):
    """30 requests of 1,000 tokens, their sockets closed after 0.3 s, on 4 slots (26 wait):
    the server stops generating for them at once, streamed or not, with or without
    --api-key. Measured by the server's own count of tokens generated: before, a request
    that did not stream was generated to its end (30,000 tokens, 34 s)."""
    args = ["--api-key", key] if key else []
    with serving("--checkpoint", str(slow_run), "--parallel", "4", "--queue", "30",
                 *args) as server:
        long = dict(prompt="ROMEO:", max_tokens=1000, temperature=1.0, stream=streamed)
        hang_up(server, 30, long, after=0.3, key=key)
        at_hang_up = server.health()["tokens"]
        for _ in range(100):  # 5 s at most
            health = server.health()
            if health["active"] == health["waiting"] == 0:
                break
            time.sleep(0.05)
        after = health["tokens"] - at_hang_up
        # a step or two of each of the 4 slots may be under way as the sockets close
        assert health["active"] == health["waiting"] == 0 and after <= 4 * 4, (after, health)
        # and the slots serve the next client as before
        answer = server.client(key or "none").completions.create(
            model="slow", **{**long, "max_tokens": 5, "stream": False})
        assert answer.usage.completion_tokens == 5


def test_a_port_in_use_is_one_line(chat_server, sft_run):
    port = chat_server.url.rsplit(":", 1)[1]
    result = subprocess.run([sys.executable, "serve.py", "--run", str(sft_run[0]), "--port",
                             port], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert error_line(result.stderr) == (
        f"error: port {port} on 127.0.0.1 is in use (another server?); stop it or choose "
        f"another --port")


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_the_chat_page_in_headless_chromium(chat_server, tmp_path):
    """Two turns typed into the page: each reply streams in and equals the API's answer to
    the same history."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    client, history = chat_server.client(), []
    try:
        driver.get(chat_server.url + "/")
        WebDriverWait(driver, 20).until(lambda d: "chat_sft" in d.find_element(By.ID, "title").text)
        driver.execute_script("document.getElementById('temperature').value = '0';")
        for n, text in enumerate(["NURSE", "ROMEO"], 1):
            driver.find_element(By.ID, "input").send_keys(text, Keys.ENTER)
            WebDriverWait(driver, 30).until(lambda d, n=n: len(
                d.find_elements(By.CSS_SELECTOR, ".assistant[data-done]")) == n)
            shown = driver.find_elements(By.CSS_SELECTOR, ".assistant")[-1].text
            history.append({"role": "user", "content": text})
            expected = client.chat.completions.create(model="chat_sft", messages=history,
                                                      temperature=0)
            assert shown == expected.choices[0].message.content.strip()
            history.append({"role": "assistant", "content": expected.choices[0].message.content})
        assert not driver.find_elements(By.CSS_SELECTOR, ".error")
        assert driver.find_elements(By.CSS_SELECTOR, ".assistant")[0].text == "Nurse loves."
    finally:
        driver.quit()


def test_logprobs_in_openais_shapes_streamed_or_whole(chat_server):
    client = chat_server.client()
    settings = dict(model="chat_sft", messages=CHAT, temperature=0.0, max_tokens=8,
                    logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**settings)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) <= 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top
    streamed = [e for chunk in client.chat.completions.create(**settings, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # a completion's legacy shape, with its prompt echoed first, streamed or whole
    args = dict(model="chat_sft", prompt="ROMEO", temperature=0.0, max_tokens=6, logprobs=1,
                echo=True)
    text = client.completions.create(**args).choices[0]
    pieces = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(p.text for p in pieces) == text.text and text.text.startswith("ROMEO")
    tokens = [t for p in pieces if p.logprobs for t in p.logprobs.tokens]
    assert tokens == text.logprobs.tokens and text.logprobs.token_logprobs[0] is None
    offsets = [o for p in pieces if p.logprobs for o in p.logprobs.text_offset]
    assert offsets == text.logprobs.text_offset
    # lm-eval's loglikelihood asks for an echo and one token: the pass that scores the
    # prompts gives it, and no prompt is prefilled into a slot
    prompts = ["ROMEO: Nurse", "JULIET: Tybalt sees"]
    before = chat_server.health()
    echoed = client.completions.create(model="chat_sft", prompt=prompts, max_tokens=1,
                                       temperature=0.0, logprobs=1, echo=True).choices
    after = chat_server.health()
    assert after["prompt_tokens_prefilled"] == before["prompt_tokens_prefilled"]
    assert after["tokens"] == before["tokens"] + 2
    for prompt, choice in zip(prompts, echoed, strict=True):
        alone = client.completions.create(model="chat_sft", prompt=prompt, max_tokens=1,
                                          temperature=0.0, logprobs=1).choices[0]
        assert choice.text == prompt + alone.text and choice.finish_reason == alone.finish_reason
        assert choice.logprobs.tokens[-1] == alone.logprobs.tokens[0]
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(alone.logprobs.token_logprobs[0],
                                                                   abs=1e-4)


def test_alternatives_past_the_vocabulary_are_all_of_it(trained_run, tmp_path):
    """A character table may hold fewer tokens than logprobs asks for: each position then
    lists every token, generated or echoed, where the alternatives were drawn past the end."""
    ckpt = load_checkpoint(trained_run / "best.pt")
    tokenizer = CharTokenizer("\nEMOR")
    torch.manual_seed(0)
    shape = {**ckpt["model_args"], "vocab_size": tokenizer.vocab_size}
    ckpt["model_args"], ckpt["model"] = shape, GPT(GPTConfig(**shape)).state_dict()
    ckpt["tokenizer"] = tokenizer.to_meta()
    save_checkpoint(ckpt, tmp_path / "five.pt")
    with serving("--checkpoint", str(tmp_path / "five.pt")) as server:
        choice = server.client().completions.create(model="five", prompt="ROME", max_tokens=3,
                                                    logprobs=20, echo=True, seed=0).choices[0]
    tops = choice.logprobs.top_logprobs[1:]
    assert len(tops) == 6 and all(set(top) == set("\nEMOR") for top in tops)


def test_ignore_eos_goes_on_to_max_tokens(chat_server):
    # vLLM's and llama.cpp's field, which benchmarks send so that every answer is as long
    client = chat_server.client()
    settings = dict(model="chat_sft", messages=CHAT, temperature=0.0, max_tokens=20)
    ended = client.chat.completions.create(**settings)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 20
    longer = client.chat.completions.create(**settings, extra_body={"ignore_eos": True})
    assert longer.choices[0].finish_reason == "length" and longer.usage.completion_tokens == 20
    assert longer.choices[0].message.content.startswith(ended.choices[0].message.content)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, char_data) -> Path:
    """The tiny model with a context of 128 tokens, room for a conversation of turns, and a
    bigram table, so that a prefill after a reused prefix must read its first token's
    predecessor from the cache."""
    from train import train
    from training.config import load_config
    out = tmp_path_factory.mktemp("long")
    train(load_config(REPO / "config" / "tiny.toml", {
        "data_dir": str(char_data), "out_dir": str(out), "run_name": "long", "block_size": 128,
        "max_iters": 30, "sample_tokens": 0, "log_attention": False, "bigram_embedding": True}))
    return out / "long"


@pytest.mark.parametrize("decode", ["c", "eager"])
def test_a_reused_prefix_answers_as_a_cold_prefill_does(long_run, decode):
    # conversations sent whole at every turn, as OpenAI's clients send them: two at once, one
    # that branches from an earlier turn, and one whose slot another request took meanwhile
    with serving("--run", str(long_run), "--parallel", "2", "--decode", decode) as server:
        client = server.client()

        def ask(prompt: str, cold: bool, seed: int | None,
                stream: bool = False) -> tuple[str, list[float]]:
            sampling = dict(temperature=0.0) if seed is None else dict(temperature=1.0, seed=seed)
            settings = dict(model="long", prompt=prompt, max_tokens=10, logprobs=1, **sampling,
                            extra_body={"cache_prompt": not cold})
            if stream:
                chunks = [c.choices[0] for c in client.completions.create(**settings, stream=True)
                          if c.choices]
                return ("".join(c.text for c in chunks),
                        [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs])
            choice = client.completions.create(**settings).choices[0]
            return choice.text, choice.logprobs.token_logprobs

        def talk(opening: str, lines: list[str], seed: int | None) -> list[tuple[str, str]]:
            """Each turn's prompt (the whole history) and its warm answer, checked against
            the same prompt prefilled whole."""
            history, turns = opening, []
            for line in lines:
                history += line
                cold = ask(history, True, seed)
                for warm in ask(history, False, seed), ask(history, False, seed, stream=True):
                    assert warm[0] == cold[0], (decode, history)
                    if decode == "c":  # every token computed alike: to the bit
                        assert warm[1] == cold[1]
                    else:
                        assert warm[1] == pytest.approx(cold[1], abs=1e-4)
                turns.append((history, warm[0]))
                history += warm[0]
            return turns

        lines = ["\nJULIET: Romeo", "\nNURSE: Tybalt", "\nROMEO: Nurse", "\nTYBALT: Juliet"]
        with ThreadPoolExecutor(2) as pool:  # .result() raises what a thread's talk raised
            for future in [pool.submit(talk, f"{who}: Nurse sees", lines, seed)
                           for who, seed in (("ROMEO", None), ("JULIET", 7))]:
                future.result(timeout=120)
        first = talk("TYBALT: Romeo", lines[:2], None)
        talk(first[0][0] + first[0][1], ["\nROMEO: Juliet"], None)  # branches from turn 1
        talk("NURSE: a rose", lines[:1], 3)  # takes a slot that held the branch
        talk(first[1][0] + first[1][1], lines[2:], None)  # its slot was taken meanwhile
        health = server.health()
        assert health["prompt_tokens_reused"] > health["prompt_tokens_prefilled"] / 4, health
        metrics = http_text(server, "/metrics")
        assert f"gptlab:prompt_tokens_reused_total{{model_name=\"long\"}} " \
               f"{health['prompt_tokens_reused']}" in metrics


def http_text(server: Server, path: str) -> str:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("GET", path)
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def test_completion_logprobs_keep_the_likeliest_of_tokens_that_read_alike(chain_server):
    """The bytes of a Chinese character are tokens that each read U+FFFD. A completion's
    alternatives are a dict keyed by text, where they share one key: it holds the
    likeliest's logprob, because lm-eval takes the largest for the greedy token's.
    return_tokens_as_token_ids (vLLM's) keys every alternative apart."""
    server, chain = chain_server
    client = server.client(CHAIN_KEY)
    settings = dict(model=CHAIN_NAME, prompt=[chain[0]], max_tokens=8, temperature=0.0,
                    logprobs=5, echo=True)
    choice = client.completions.create(**settings).choices[0]
    lp = choice.logprobs
    assert choice.text == "<|assistant_start|>" + CHAIN_TEXT
    assert lp.tokens == ["<|assistant_start|>"] + ["\ufffd"] * 8 and lp.top_logprobs[0] is None
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top == {"\ufffd": logprob} and logprob > -1e-3  # the greedy token's own
    # each token's offset points at the character it starts or continues
    assert [choice.text[at] for at in lp.text_offset[1:]] == [c for c in CHAIN_TEXT for _ in "ab"]
    assert lp.text_offset[0] == 0
    by_id = client.completions.create(**settings, extra_body={"return_tokens_as_token_ids": True})
    lp = by_id.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in chain]
    bytes_first = [f"token_id:{GPT2Tokenizer().ranks[bytes([b])]}" for b in range(0x80, 0x94)]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                   strict=True):
        assert list(top) == [token, *[t for t in bytes_first if t != token][:4]]
        assert top[token] == logprob and list(top.values()) == sorted(top.values(), reverse=True)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        **settings, stream=True, extra_body={"return_tokens_as_token_ids": True}) if c.choices
        and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [t for s in streamed for t in s.top_logprobs] == lp.top_logprobs


def test_chat_logprobs_give_every_alternative_with_its_own_bytes(chain_server):
    """Chat's top_logprobs are a list, which holds every alternative asked for, tokens that
    read alike included, and each token's bytes are its own (not U+FFFD's), so that
    consecutive tokens' bytes join into the text's characters, as OpenAI defines them."""
    server, chain = chain_server
    tokenizer = GPT2Tokenizer()
    settings = dict(model=CHAIN_NAME, messages=[{"role": "user", "content": "你好"}],
                    max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=20)
    client = server.client(CHAIN_KEY)
    answer = client.chat.completions.create(**settings)
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content == CHAIN_TEXT
    assert b"".join(bytes(e.bytes) for e in content) == CHAIN_TEXT.encode("utf-8")
    assert [bytes(e.bytes) for e in content] == [tokenizer.decode_bytes([t]) for t in chain[1:]]
    for entry in content:
        assert entry.token == "\ufffd" and len(entry.top_logprobs) == 20
        assert entry.top_logprobs[0].bytes == entry.bytes
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert len({bytes(t.bytes) for t in entry.top_logprobs}) == 20
    by_id = client.chat.completions.create(**settings,
                                           extra_body={"return_tokens_as_token_ids": True})
    for entry, token in zip(by_id.choices[0].logprobs.content, chain[1:], strict=True):
        assert entry.token == f"token_id:{token}"
        for alternative in entry.top_logprobs:
            named = int(alternative.token.removeprefix("token_id:"))
            assert bytes(alternative.bytes) == tokenizer.decode_bytes([named])
    streamed = [e for c in client.chat.completions.create(**settings, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def health_meanwhile(server: Server, path: str, body: str,
                     headers: dict[str, str]) -> tuple[float, list[float], int, bytes]:
    """POST `body` to `path`, and ask /health again and again on another connection until
    its answer has come: the POST's duration, how long each /health asked meanwhile took,
    and the POST's status and raw answer (the caller parses it after the timing, because
    parsing holds this process's interpreter lock)."""
    host, port = server.url.removeprefix("http://").split(":")
    posted: list[tuple[float, float, int, bytes]] = []

    def post() -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        start = time.monotonic()
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        posted.append((start, time.monotonic(), response.status, raw))

    worker = threading.Thread(target=post)
    worker.start()
    asked, connection = [], http.client.HTTPConnection(host, int(port), timeout=120)
    while worker.is_alive() and len(asked) < 100_000:
        sent = time.monotonic()
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        asked.append((sent, time.monotonic() - sent))
    worker.join(timeout=120)
    (start, end, status, raw), = posted
    return end - start, [took for sent, took in asked if start <= sent <= end], status, raw


def test_a_large_tokenize_holds_no_other_request_back(chain_server):
    """A megabyte to /tokenize is most of a million ids to count and write, work that must
    not hold the event loop. /health is asked again and again while it runs: no answer may
    take half as long as the tokenizing does (where the loop waited for the work, one took
    nearly all of it)."""
    server, _ = chain_server
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "!#$%&()*+,-./:;<=>?@[]^_`{|}~ "
    body = json.dumps({"prompt": "".join(rng.choice(alphabet) for _ in range(1_000_000))})
    took, health, status, raw = health_meanwhile(server, "/tokenize", body, {
        "Authorization": f"Bearer {CHAIN_KEY}", "content-type": "application/json"})
    answer = json.loads(raw)
    assert status == 200 and answer["count"] == len(answer["tokens"]) > 500_000
    assert len(health) >= 3 and max(health) < took / 2, (len(health), max(health), took)


def test_many_prompts_in_one_request_hold_no_other_request_back(chat_server):
    """lm-eval sends its loglikelihood requests many prompts at a time, each echoed with one
    token and its logprobs. The work of a prompt's job and answer is done in a thread, and
    none of it grows with the square of the prompts: /health, asked again and again
    meanwhile, never waits half as long as the request."""
    prompts = [[i % 40 + 1, i % 7 + 1] for i in range(10_000)]
    body = json.dumps({"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1,
                       "temperature": 0})
    took, health, status, raw = health_meanwhile(chat_server, "/v1/completions", body,
                                                 {"content-type": "application/json"})
    choices = json.loads(raw)["choices"]
    assert status == 200 and [c["index"] for c in choices] == list(range(10_000))
    assert all(len(c["logprobs"]["tokens"]) == 3 for c in choices)
    assert len(health) >= 3 and max(health) < took / 2, (len(health), max(health), took)


def test_metrics_are_prometheus_text_whatever_the_models_name(chain_server):
    """The model is named after its file, here with a quote and a backslash, which end a
    label's value unless escaped: Prometheus's own parser reads every sample back."""
    parser = pytest.importorskip("prometheus_client.parser")
    server, _ = chain_server
    health = server.health()
    families = parser.text_string_to_metric_families(http_text(server, "/metrics"))
    samples = {s.name: s for family in families for s in family.samples}
    assert {s.labels["model_name"] for s in samples.values()} == {CHAIN_NAME}
    assert len(samples) == len(METRICS)
    assert samples["gptlab:generation_tokens_total"].value == health["tokens"]
    assert samples["gptlab:num_requests_waiting"].value == health["waiting"]
    # and a line feed, the third character the format escapes
    name = 'a "b" \\c\nd'
    text = prometheus(name, {key: 7 for key, _, _ in METRICS.values()})
    samples = [s for family in parser.text_string_to_metric_families(text) for s in family.samples]
    assert [(s.labels, s.value) for s in samples] == [({"model_name": name}, 7)] * len(METRICS)


def test_the_key_guards_every_route_that_reads_a_body(chain_server):
    """With --api-key, every route needs the key but the chat page, /health and /metrics,
    as vLLM's: /tokenize and /detokenize compute on bodies of up to 1 MB."""
    server, _ = chain_server
    routes = [("POST", "/tokenize", '{"prompt": "hi"}'), ("POST", "/detokenize", '{"tokens": [5]}'),
              ("GET", "/tokenizer_info", None), ("GET", "/v1/models", None),
              ("POST", "/v1/completions", '{"prompt": "hi", "max_tokens": 1}')]
    for method, path, body in routes:
        for shown in ({}, {"Authorization": "Bearer wrong"}):
            code, _, answer = server.request(method, path, body,
                                             {"content-type": "application/json", **shown})
            assert code == 401 and answer["error"]["code"] == "invalid_api_key", (path, answer)
        code, _, answer = server.request(method, path, body, {
            "content-type": "application/json", "Authorization": f"Bearer {CHAIN_KEY}"})
        assert code == 200, (path, answer)
    assert server.request("GET", "/health")[0] == 200
    assert "gptlab:prompt_tokens_total" in http_text(server, "/metrics")
    assert "<html" in http_text(server, "/").lower()
