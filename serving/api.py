"""OpenAI's request and response shapes, as far as this server speaks them.

Usage:
    body = ChatRequest.model_validate(json)      # pydantic checks types and ranges
    error_body("n must be 1", param="n")         # {"error": {"message", "type", "param", "code"}}
    event = chunk(meta, "Hi")                    # one server-sent event's data
    Logprobs(tokenizer, chat=False).shape(tokens, offsets)   # a choice's logprobs object

Fields that OpenAI defines but that change nothing here (user, metadata, ...) are accepted
and ignored, because clients send them. A field that would change the answer but that this
server cannot honour (n > 1, response_format, tools, penalties; see UNHONOURED) is refused
by name, with a 400 whose param is the field, unless its value asks for nothing (n of 1,
{"type": "text"}, an empty list of tools). top_k and skip_special_tokens are not OpenAI's
fields, but vLLM takes both, llama.cpp's server takes top_k, and so does sample.py;
cache_prompt is llama.cpp's.

The logprobs fields are OpenAI's and vLLM's. A completion takes `logprobs` (how many
alternatives per token) and `echo` (the prompt's tokens come back first, with their
logprobs, the first of them null), and its `logprobs` object holds tokens, token_logprobs,
top_logprobs and text_offset. A chat takes `logprobs: true` and `top_logprobs`, and answers
in choices[].logprobs.content[]. A completion's prompt is a string, a list of strings, a
list of token ids or a list of lists of them, the shapes lm-eval sends; each prompt gets a
choice of its own, with its index. `Logprobs` writes both logprobs shapes, and nothing else
writes them.

Every field is strict, as in OpenAI's API: a token id, a count or a seed must be an integer
(not true, 1.0 or "1"), a switch must be a boolean, and a number must be finite. pydantic's
lax mode would read `prompt: [true, false, 5]` as the tokens 1, 0 and 5, and "yes" as true.
The body itself is strict JSON, ignored fields included (serving/body.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from data.text import check_text
from data.tokenizer import Tokenizer

NO_TOOLS = "this server calls no tools (its models were not trained to); drop the field"
NOT_HERE = "not supported here; drop the field"
MAX_LOGPROBS = 20  # the most alternatives per token, as vLLM's default
# Every request ignores unknown fields and never reads one type as another (the module's
# docstring says why).
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
PROMPT_SHAPES = ("must be a string, a list of strings, a list of token ids (integers) or a "
                 "list of lists of token ids")
# field -> (the values that ask for nothing, the reason any other value is refused), the
# reason following "field: " in the message
UNHONOURED: dict[str, tuple[list, str]] = {
    "n": ([1], "this server returns one choice per request; send n requests instead"),
    "best_of": ([1], "this server draws one answer per request; drop the field"),
    "suffix": ([""], NOT_HERE),
    "response_format": ([{"type": "text"}], "this server answers in free text and cannot "
                        "hold an answer to JSON or to a schema; drop the field (or send "
                        "{\"type\": \"text\"}) and ask for JSON in the prompt"),
    "tools": ([[]], NO_TOOLS),
    "tool_choice": (["none", "auto"], NO_TOOLS),
    "functions": ([[]], NO_TOOLS),
    "function_call": (["none", "auto"], NO_TOOLS),
    "frequency_penalty": ([0], "penalties are not applied here; drop the field or send 0"),
    "presence_penalty": ([0], "penalties are not applied here; drop the field or send 0"),
    "logit_bias": ([{}], NOT_HERE),
}


def prompt_kind(prompt: Any) -> str | None:
    """Which of a completion's four prompt shapes a prompt takes, judged by its first item,
    so that only that shape is checked. pydantic's plain union would try each shape on every
    item and record an error for each, in time that grows with the prompt."""
    if isinstance(prompt, str):
        return "text"
    if not isinstance(prompt, list):
        return None
    head = prompt[0] if prompt else 0  # an empty list passes as ids; check_prompt refuses it
    return "texts" if isinstance(head, str) else "batch" if isinstance(head, list) else "ids"


Prompt = Annotated[Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")]
                   | Annotated[list[int], Tag("ids")] | Annotated[list[list[int]], Tag("batch")],
                   Discriminator(prompt_kind)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class BaseRequest(BaseModel):
    """What both completion endpoints take."""
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0, with echo, asks for the prompt's logprobs alone
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True  # vLLM's field: leave tokens like <|assistant_end|> out of text
    cache_prompt: bool = True  # llama.cpp's field: false prefills the whole prompt, reusing nothing
    ignore_eos: bool = False  # vLLM's and llama.cpp's field: go past the end token to max_tokens
    # vLLM's field: logprobs name each token "token_id:N", so that tokens with the same text
    # stay apart
    return_tokens_as_token_ids: bool = False
    # refused unless they ask for nothing (UNHONOURED); a count is an integer, as every
    # count above is, so n: 1.0 is refused as max_tokens: 1.0 is
    n: int | None = None
    best_of: int | None = None
    suffix: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    @field_validator(*UNHONOURED)
    @classmethod
    def honoured(cls, value: Any, info: ValidationInfo) -> Any:
        asks_nothing, why = UNHONOURED[info.field_name]
        # In Python true == 1, so n: true would pass for n: 1 unless the types must agree too
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                         for v in asks_nothing):
            raise ValueError(why)
        return value

    @field_validator("stop")
    @classmethod
    def check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 16:  # OpenAI's limit is 4; lm-eval's tasks may name more
            raise ValueError("takes at most 16 strings")
        if any(not s for s in stops):
            raise ValueError("has an empty string, which would end every answer at once")
        for i, s in enumerate(stops, 1):
            check_text(s, f"stop string {i}")  # the rule for every text this server takes
        return stop

    @property
    def alternatives(self) -> int | None:
        """The logprobs asked for each generated token: None, or how many alternatives."""
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(BaseRequest):
    # checked by data.chat.check_conversation, whose messages name the message at fault
    messages: list[Any]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("max_tokens")
    @classmethod
    def some_tokens(cls, max_tokens: int | None) -> int | None:
        if max_tokens == 0:  # a completion's echo may ask for none; a chat has nothing to echo
            raise ValueError("must be at least 1")
        return max_tokens

    @model_validator(mode="after")
    def check_asks(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs asks for logprobs: send logprobs: true with it")
        return self

    @property
    def alternatives(self) -> int | None:
        """The logprobs asked for each generated token: None, or how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(BaseRequest):
    prompt: Prompt = ""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="wrap")
    @classmethod
    def check_prompt(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> str | list:
        """The prompt in one of its four shapes, or an error that names the first item that
        fits none of them (pydantic's own message would name the shape it tried, such as
        "prompt.ids.0")."""
        try:
            prompt = handler(prompt)
        except ValidationError:
            raise ValueError(f"{PROMPT_SHAPES}; {misfit(prompt)}") from None
        if isinstance(prompt, list) and not prompt:
            raise ValueError("is an empty list; send a string, strings, or token ids")
        return prompt

    @model_validator(mode="after")
    def something_asked(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing without echo: ask for at least "
                             "one token, or send echo: true to have the prompt's logprobs")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as a text or as token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def alternatives(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """/tokenize's body, as vLLM takes it. add_special_tokens changes nothing, because no
    tokenizer here adds special tokens."""
    model_config = STRICT
    prompt: str
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def is_text(cls, prompt: str) -> str:
        return check_text(prompt, "the text")  # the rule for every text this server takes


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    tokens: list[int]


def is_token_id(value: object) -> bool:
    """Whether a JSON value can be a token id: an integer that is not a boolean (Python's
    bool is a subclass of int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def misfit(prompt: Any) -> str:
    """Where a prompt first leaves the shapes it may take, and what it holds there."""
    if not isinstance(prompt, list) or not prompt:
        return f"it is {shown(prompt)}"
    head = prompt[0]
    for i, item in enumerate(prompt):
        if isinstance(head, list) and isinstance(item, list):
            bad = next((j for j, t in enumerate(item) if not is_token_id(t)), None)
            if bad is not None:
                return f"prompt[{i}][{bad}] is {shown(item[bad])}"
        elif not (isinstance(head, str) and isinstance(item, str)
                  or is_token_id(head) and is_token_id(item)):
            return f"prompt[{i}] is {shown(item)}"
    return f"it is {shown(prompt)}"


def shown(value: object) -> str:
    """A JSON value as an error message quotes it, shortened if it is long."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def refusal(errors: Sequence[dict], body: Any) -> tuple[str, str | None]:
    """The message and the param for a request that pydantic refused. The message gives the
    first error at the deepest place in the body, named by its path in the body ("stop[0]"),
    because pydantic's own paths name the union member it tried ("stop.list[str].0"), which
    no client wrote."""
    found = [(path_in(body, error), error) for error in errors]
    path, error = max(found, key=lambda pair: len(pair[0]))  # the first of the deepest
    what = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
    kind = error.get("type", "")
    if isinstance(body, bytes):  # FastAPI reads JSON only under a JSON content type
        return ("the body is not marked as JSON; send a JSON object with Content-Type: "
                "application/json"), None
    if not path and isinstance(body, dict):  # a rule across fields (from a model validator)
        return what, None
    if not path:
        return (f"the body is {'empty' if kind == 'missing' else shown(body)}, not a JSON "
                f"object; send one, with Content-Type: application/json"), None
    if kind.endswith("_type") or kind == "finite_number":
        what += f", not {shown(error.get('input'))}"
    return f"{path_name(path)}: {what}", str(path[0])


def path_name(path: list[str | int]) -> str:
    """A place in a body as a reader writes it: messages[0].content."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).removeprefix(".")


def path_in(body: Any, error: dict) -> list[str | int]:
    """An error's place in the body, as keys and indices: the parts of pydantic's path
    that lead through the body's objects and lists, plus a missing field's name."""
    path, here, loc = [], body, list(error.get("loc", ()))[1:]  # loc[0] is "body"
    for n, part in enumerate(loc):
        if isinstance(here, dict) and isinstance(part, str) and part in here:
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here):
            here = here[part]
        elif not (error.get("type") == "missing" and n == len(loc) - 1):
            continue  # a union member's name, or a validator's
        path.append(part)
    return path


class APIError(Exception):
    """A request this server refuses, with its HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = error_body(message, type, param, code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape, which its clients raise as their own exceptions."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Meta:
    """The fields that every chunk and answer of one request repeat."""
    object: Literal["chat.completion", "text_completion"]
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, streamed: bool = False) -> dict:
        """The fields that an answer, or a streamed chunk of one, opens with. A chat's
        chunks have the object "chat.completion.chunk"; a text completion's chunks keep its
        own object."""
        chat = self.object == "chat.completion"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + self.id,
                "object": self.object + (".chunk" if chat and streamed else ""),
                "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(meta: Meta, text: str | None, finish_reason: str | None, *, delta: bool,
           index: int = 0, logprobs: dict | None = None) -> dict:
    """A choice of an answer (delta False) or of a streamed chunk (delta True), with
    logprobs in the endpoint's own shape (Logprobs.shape) or None."""
    if meta.object == "text_completion":
        return {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish_reason}
    body = {"role": "assistant", "content": text} if not delta else \
        {} if text is None else {"content": text}
    return {"index": index, "message" if not delta else "delta": body, "logprobs": logprobs,
            "finish_reason": finish_reason}


def answer(meta: Meta, choices: list[dict], counts: dict) -> bytes:
    """The whole answer to a request that did not stream, as JSON, with each choice written
    by a separate call (json_object says why)."""
    return json_object({**meta.head(), "usage": counts}, "choices", map(dumps, choices))


def dumps(value: object) -> str:
    """JSON as the answers write it: compact, with text as it is rather than escaped."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_object(fields: dict, name: str, items: Iterable[str]) -> bytes:
    """A JSON object of `fields`, followed by a list under `name` whose items (or runs of
    items) come already written, each by its own json.dumps call. One call holds the
    interpreter's lock for everything it writes, so a large answer written in one call would
    hold back the event loop the whole time, even from another thread."""
    head = dumps(fields)[:-1] + ("," if fields else "")
    return f"{head}{dumps(name)}:[{','.join(items)}]}}".encode()


def chunk(meta: Meta, text: str | None, finish_reason: str | None = None, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One streamed event: a piece of text, or the finish reason at the end."""
    return {**meta.head(streamed=True), "choices": [
        choice(meta, text, finish_reason, delta=True, index=index, logprobs=logprobs)]}


@dataclass(frozen=True)
class Logprob:
    """A token of an answer as logprobs report it: its id, its logprob (None where nothing
    predicts it, as for an echoed prompt's first token) and the likeliest tokens at its
    position, as (id, logprob) pairs, likeliest first."""
    id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


class Logprobs:
    """The only writer of logprobs in OpenAI's shapes, for one request: a completion's
    legacy object (each position's alternatives as a dict from name to logprob), or a chat's
    content list (each alternative an entry of its own, with its bytes). A token is named by
    its text or, with vLLM's return_tokens_as_token_ids, by "token_id:N"."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, token_ids: bool = False) -> None:
        self.tokenizer, self.chat, self.token_ids = tokenizer, chat, token_ids
        self.decode_bytes = getattr(tokenizer, "decode_bytes", None)  # only a byte-level BPE has it

    def shape(self, tokens: list[Logprob], offsets: list[int]) -> dict:
        """The logprobs object of these tokens. `offsets` says where each token's text starts
        in the choice's text, which only a completion reports."""
        if self.chat:
            return {"content": [{**self.entry(t.id, t.logprob),
                                 "top_logprobs": [self.entry(i, lp) for i, lp in t.top]}
                                for t in tokens]}
        return {"tokens": [self.name(t.id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.logprob is None else self.alternatives(t)
                                 for t in tokens],
                "text_offset": offsets}

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.token_ids else self.tokenizer.decode([token])

    def entry(self, token: int, logprob: float | None) -> dict:
        """A chat's token: its name, its logprob and its own UTF-8 bytes. Tokens that each
        hold part of a character all read U+FFFD as text, so only their bytes can join into
        that character."""
        raw = (self.decode_bytes([token]) if self.decode_bytes is not None
               else self.tokenizer.decode([token]).encode("utf-8"))
        return {"token": self.name(token), "logprob": logprob, "bytes": list(raw)}

    def alternatives(self, token: Logprob) -> dict[str, float]:
        """A completion's alternatives, likeliest first, plus the token's own logprob, as
        OpenAI's legacy shape has it (up to logprobs + 1 entries). Tokens with the same name
        (the bytes of one character, which all read U+FFFD) share a key, and the key keeps
        the likeliest one's logprob, because lm-eval reads the largest value as the greedy
        token's."""
        named: dict[str, float] = {}
        for i, logprob in (*token.top, (token.id, token.logprob)):
            named.setdefault(self.name(i), logprob)
        return named


def role_chunk(meta: Meta) -> dict:
    """A chat stream's first event, which names the speaker, as OpenAI's does."""
    return {**meta.head(streamed=True), "choices": [{
        "index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def usage_chunk(meta: Meta, counts: dict) -> dict:
    """The last event when stream_options.include_usage asks for it: the usage, with no
    choices."""
    return {**meta.head(streamed=True), "choices": [], "usage": counts}
