"""OpenAI's request and response shapes, as far as this server speaks them.

Usage:
    body = ChatRequest.model_validate(json)      # pydantic checks types and ranges
    error_body("n must be 1", param="n")         # {"error": {"message", "type", "param", "code"}}
    chunk = chat_chunk(meta, {"content": "Hi"})  # one server-sent event's data

Fields OpenAI defines that change nothing here (user, metadata, ...) are accepted and
ignored, as clients send them. A field that would change the answer and that this server
cannot honour (n > 1, logprobs, response_format, tools, penalties: UNHONOURED) is refused
by name, with a 400 whose param is the field, unless its value asks for nothing (n 1,
{"type": "text"}, an empty list of tools). top_k and skip_special_tokens are not OpenAI's,
but vLLM takes both and llama.cpp's server top_k, and so does sample.py.
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
# field -> (the values that ask for nothing, why any other is refused, after "field: ")
UNHONOURED: dict[str, tuple[list, str]] = {
    "n": ([1], "this server returns one choice per request; send n requests instead"),
    "best_of": ([1], "this server draws one answer per request; drop the field"),
    "logprobs": ([False, 0], NOT_HERE),
    "top_logprobs": ([0], NOT_HERE),
    "echo": ([False], NOT_HERE),
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
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    skip_special_tokens: bool = True  # vLLM's: leave <|assistant_end|> and its kind out of text
    # refused unless they ask for nothing (UNHONOURED)
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
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
        if len(stops) > 4:
            raise ValueError("takes at most 4 strings")
        if any(not s for s in stops):
            raise ValueError("has an empty string, which would end every answer at once")
        for i, s in enumerate(stops, 1):
            check_text(s, f"stop string {i}")  # the rule of every text this server takes
        return stop

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


class CompletionRequest(BaseRequest):
    prompt: str | list[str] = ""

    @model_validator(mode="after")
    def one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt takes one string (a list of one); send one request per "
                             "prompt")
        return self

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


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


def choice(meta: Meta, text: str | None, finish_reason: str | None, *, delta: bool) -> dict:
    """A choice of an answer (delta False) or of a streamed chunk (delta True)."""
    if meta.object == "text_completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not delta:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason}
    return {"index": 0, "delta": {} if text is None else {"content": text},
            "finish_reason": finish_reason}


def answer(meta: Meta, text: str, finish_reason: str, counts: dict) -> dict:
    """The whole answer of a request that did not stream."""
    return {**meta.head(), "choices": [choice(meta, text, finish_reason, delta=False)],
            "usage": counts}


def chunk(meta: Meta, text: str | None, finish_reason: str | None = None) -> dict:
    """One streamed event: a piece of text, or the finish reason at the end."""
    return {**meta.head(streamed=True), "choices": [choice(meta, text, finish_reason, delta=True)]}


def role_chunk(meta: Meta) -> dict:
    """A chat stream's first event, which names the speaker, as OpenAI's does."""
    return {**meta.head(streamed=True), "choices": [{
        "index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def usage_chunk(meta: Meta, counts: dict) -> dict:
    """The last event when stream_options.include_usage asks for it: no choices, the usage."""
    return {**meta.head(streamed=True), "choices": [], "usage": counts}
