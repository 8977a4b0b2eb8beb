"""OpenAI's request and response shapes, as far as this server speaks them.

Usage:
    body = ChatRequest.model_validate(json)      # pydantic checks types and ranges
    error_body("n must be 1", param="n")         # {"error": {"message", "type", "param", "code"}}
    chunk = chat_chunk(meta, {"content": "Hi"})  # one server-sent event's data

Fields OpenAI defines that change nothing here (user, metadata, ...) are accepted and
ignored, as clients send them. A field that would change the answer and that this server
cannot honour (n > 1, response_format, tools, penalties: UNHONOURED) is refused by name,
with a 400 whose param is the field, unless its value asks for nothing (n 1, {"type":
"text"}, an empty list of tools). top_k and skip_special_tokens are not OpenAI's, but vLLM
takes both and llama.cpp's server top_k, and so does sample.py; cache_prompt is llama.cpp's.

Logprobs are OpenAI's and vLLM's: a completion's `logprobs` (how many alternatives per
token) and `echo` (the prompt's tokens come back first, with their logprobs; the first is
null), whose `logprobs` object holds tokens, token_logprobs, top_logprobs and text_offset;
a chat's `logprobs: true` and `top_logprobs`, as choices[].logprobs.content[]. A
completion's prompt is a string, a list of strings, a list of token ids or a list of lists
of them: one choice per prompt, each with its index, as lm-eval sends them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from data.text import check_text

NO_TOOLS = "this server calls no tools (its models were not trained to); drop the field"
NOT_HERE = "not supported here; drop the field"
MAX_LOGPROBS = 20  # alternatives per token at most, as vLLM's default
# field -> (the values that ask for nothing, why any other is refused, after "field: ")
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


class BaseRequest(BaseModel):
    """What both completion endpoints take."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt's logprobs alone
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    skip_special_tokens: bool = True  # vLLM's: leave <|assistant_end|> and its kind out of text
    cache_prompt: bool = True  # llama.cpp's: false prefills the whole prompt, reusing nothing
    ignore_eos: bool = False  # vLLM's and llama.cpp's: go on past the end token, to max_tokens
    # refused unless they ask for nothing (UNHONOURED)
    n: Any = None
    best_of: Any = None
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
        if value is not None and value not in asks_nothing:
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
            check_text(s, f"stop string {i}")  # the rule of every text this server takes
        return stop

    @property
    def alternatives(self) -> int | None:
        """The logprobs asked of each generated token: None, or how many alternatives."""
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


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
        """The logprobs asked of each generated token: None, or how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(BaseRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def some_prompt(cls, prompt: str | list) -> str | list:
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
        """Each prompt: a text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def alternatives(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """/tokenize's body, as vLLM takes it (add_special_tokens: no tokenizer here adds any)."""
    model_config = ConfigDict(extra="ignore")
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class APIError(Exception):
    """A request this server refuses: the status and OpenAI's error body."""

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
    """What every chunk and answer of one request repeats."""
    object: Literal["chat.completion", "text_completion"]
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, streamed: bool = False) -> dict:
        """The fields an answer, or a streamed chunk of one, opens with (a chat's chunks
        are "chat.completion.chunk"; a text completion's chunks keep its object)."""
        chat = self.object == "chat.completion"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + self.id,
                "object": self.object + (".chunk" if chat and streamed else ""),
                "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(meta: Meta, text: str | None, finish_reason: str | None, *, delta: bool,
           index: int = 0, logprobs: dict | None = None) -> dict:
    """A choice of an answer (delta False) or of a streamed chunk (delta True); logprobs in
    the endpoint's own shape (text_logprobs or chat_logprobs), or None."""
    if meta.object == "text_completion":
        return {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish_reason}
    body = {"role": "assistant", "content": text} if not delta else \
        {} if text is None else {"content": text}
    return {"index": index, "message" if not delta else "delta": body, "logprobs": logprobs,
            "finish_reason": finish_reason}


def answer(meta: Meta, choices: list[dict], counts: dict) -> dict:
    """The whole answer of a request that did not stream."""
    return {**meta.head(), "choices": choices, "usage": counts}


def chunk(meta: Meta, text: str | None, finish_reason: str | None = None, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One streamed event: a piece of text, or the finish reason at the end."""
    return {**meta.head(streamed=True), "choices": [
        choice(meta, text, finish_reason, delta=True, index=index, logprobs=logprobs)]}


@dataclass
class Logprob:
    """A token of an answer as logprobs show it: its text, and its logprob and the
    alternatives', as text -> logprob (None where nothing predicts it: a prompt's first)."""
    text: str
    logprob: float | None
    top: dict[str, float] | None


def text_logprobs(tokens: list[Logprob], offset: int = 0) -> dict:
    """A completion's logprobs object (OpenAI's legacy shape, which lm-eval reads): each
    token's text, logprob, alternatives and where its text starts in the choice's text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [t.top for t in tokens], "text_offset": offsets}


def chat_logprobs(tokens: list[Logprob]) -> dict:
    """A chat answer's logprobs object: choices[].logprobs.content[], each token with its
    UTF-8 bytes and its top alternatives."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t.text, t.logprob),
                         "top_logprobs": [entry(text, lp) for text, lp in (t.top or {}).items()]}
                        for t in tokens]}


def role_chunk(meta: Meta) -> dict:
    """A chat stream's first event, which names the speaker, as OpenAI's does."""
    return {**meta.head(streamed=True), "choices": [{
        "index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def usage_chunk(meta: Meta, counts: dict) -> dict:
    """The last event when stream_options.include_usage asks for it: no choices, the usage."""
    return {**meta.head(streamed=True), "choices": [], "usage": counts}
