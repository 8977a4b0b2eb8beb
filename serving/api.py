"""OpenAI's request and response shapes, as far as this server speaks them.

Usage:
    body = ChatRequest.model_validate(json)      # pydantic checks types and ranges
    error_body("n must be 1", param="n")         # {"error": {"message", "type", "param", "code"}}
    chunk = chat_chunk(meta, {"content": "Hi"})  # one server-sent event's data

Fields OpenAI defines that change nothing here (user, frequency_penalty 0, ...) are
accepted and ignored, as clients send them; a value this server cannot honour (n > 1,
logprobs) is refused by name rather than ignored. top_k is not OpenAI's, but llama.cpp's
server and vLLM take it, and so does sample.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from data.text import check_text


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
    n: int = Field(1, ge=1)
    logprobs: bool | int | None = None

    @model_validator(mode="after")
    def check(self) -> BaseRequest:
        if self.n != 1:
            raise ValueError("n must be 1: this server returns one choice per request; send "
                             "n requests instead")
        if self.logprobs:
            raise ValueError("logprobs are not supported; drop the field")
        return self

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
    echo: bool = False

    @model_validator(mode="after")
    def one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt takes one string (a list of one); send one request per "
                             "prompt")
        if self.echo:
            raise ValueError("echo is not supported; drop the field")
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
