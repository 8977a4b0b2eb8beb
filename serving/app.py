"""The HTTP side: OpenAI's endpoints and the chat page, a thin shell over one Engine.

Usage:
    app = create_app(Service(engine, tokenizer, "chat_sft", block_size=1024, max_tokens=500,
                             temperature=0.8))
    uvicorn.Server(uvicorn.Config(app)).run()        # serve.py does this

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events
with "stream": true), GET /v1/models, /health, and / (serving/chat.html). Every error is a
4xx in OpenAI's shape (serving/api.py), never a traceback: bad JSON and bad fields 400, a
wrong or missing key 401 (with --api-key), an unknown model 404, a body over 1 MB 413, a
full queue 429 with Retry-After. A client that hangs up cancels its request, streamed or
not, waiting or running: a task per request waits for the disconnect (`until_gone`), and
the API key is checked by a plain ASGI middleware (ApiKey), which leaves it visible.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from data.chat import ASSISTANT_END, ConversationError, check_conversation, render_prompt, special_ids
from data.tokenizer import Tokenizer
from generate import prompt_ids
from serving.api import (
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    Meta,
    answer,
    chunk,
    error_body,
    role_chunk,
    usage,
    usage_chunk,
)
from serving.engine import Done, Engine, Job, Piece, QueueFull, Sampling
from serving.limits import BodyLimit

PAGE = Path(__file__).with_name("chat.html")
CUT_SHORT = {  # what a client hears of an answer that the engine ended early
    "cancelled": "the server is stopping and cut this answer short; try again once it is back",
    "error": "the server failed while answering (its log has the traceback); try again",
}


class APIError(Exception):
    """A request this server refuses: the status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = error_body(message, type, param, code)


@dataclass
class Service:
    """What the routes serve: the engine, the model's tokenizer and context, its name, the
    sampling defaults (serve.py's options), and the API key, if any."""
    engine: Engine
    tokenizer: Tokenizer
    name: str
    block_size: int
    max_tokens: int
    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))  # what /v1/models says

    def sampling(self, body: BaseRequest, prompt_len: int, max_tokens: int | None,
                 prompt_field: str) -> Sampling:
        """The request's sampling, the defaults filling what it leaves out; a request that
        cannot fit in the context is refused by name."""
        room = self.block_size - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt takes {prompt_len} tokens and the model's context "
                                f"holds {self.block_size}, with room for at least one more; "
                                f"shorten it", prompt_field, "context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"the prompt takes {prompt_len} tokens and max_tokens asks for "
                                f"{max_tokens} more, past the model's context of "
                                f"{self.block_size} tokens; ask for at most {room}",
                           "max_tokens", "context_length_exceeded")
        return Sampling(max_tokens=min(given(max_tokens, self.max_tokens), room),
                        temperature=given(body.temperature, self.temperature),
                        top_k=given(body.top_k, self.top_k), top_p=given(body.top_p, self.top_p),
                        seed=body.seed, stop=body.stops,
                        skip_special_tokens=body.skip_special_tokens)

    def check_model(self, body: BaseRequest) -> None:
        if body.model not in (None, self.name):
            raise APIError(404, f"the model {body.model!r} is not served here; this server "
                                f"serves {self.name!r} (GET /v1/models)", "model",
                           "model_not_found")


def given(value: object, default: object) -> object:
    """A request's value, or the server's default where the request leaves it out."""
    return default if value is None else value


def chat_job(service: Service, body: ChatRequest, deliver: Callable) -> Job:
    """A chat request's job: the messages rendered as the chat REPL renders them."""
    try:
        ends = {special_ids(service.tokenizer)[ASSISTANT_END]}
        turns = check_conversation(body.messages, ends_with="user")
        ids = render_prompt(service.tokenizer, turns)
    except ConversationError as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    except ValueError as e:  # a base model's tokenizer, a character the vocabulary lacks
        raise APIError(400, str(e), "messages") from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    return Job(ids, service.sampling(body, len(ids), max_tokens, "messages"), ends, deliver,
               service.tokenizer)


def completion_job(service: Service, body: CompletionRequest, deliver: Callable) -> Job:
    """A completion request's job: the prompt continued as sample.py --prompt does."""
    try:
        ids = prompt_ids(service.tokenizer, body.text)
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None
    eot = service.tokenizer.eot_token
    return Job(ids, service.sampling(body, len(ids), body.max_tokens, "prompt"),
               set() if eot is None else {eot}, deliver, service.tokenizer)


async def respond(service: Service, request: Request, body: BaseRequest,
                  make_job: Callable, meta: Meta) -> JSONResponse | StreamingResponse:
    """Submit the request's job, then stream its events or gather them into one answer."""
    service.check_model(body)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(event: Piece | Done) -> None:  # called from the engine's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server is gone
            pass

    job = make_job(service, body, deliver)
    try:
        service.engine.submit(job)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    if body.stream:
        return StreamingResponse(stream_events(job, events, meta, body.include_usage, request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await gather(job, events, meta, request)


async def until_gone(request: Request, job: Job) -> None:
    """Cancel the job once its client hangs up. Run as a task beside the one that waits for
    the job's events: ASGI says a disconnect by the next message of `receive` (the body
    has been read), which comes at once, whether tokens flow or the job still waits."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def stream_events(job: Job, events: asyncio.Queue, meta: Meta, include_usage: bool,
                        request: Request) -> AsyncIterator[str]:
    """The job's events as server-sent events, ending with data: [DONE]. A client that
    hangs up cancels the job, which frees its slot or its place in the queue."""
    watcher = asyncio.create_task(until_gone(request, job))
    try:
        if meta.object == "chat.completion":
            yield sse(role_chunk(meta))
        while True:
            event = await events.get()
            if isinstance(event, Piece):
                yield sse(chunk(meta, event.text))
                continue
            if event.finish_reason in ("stop", "length"):
                yield sse(chunk(meta, None, event.finish_reason))
            else:  # headers are sent: an error can only be an event of its own
                yield sse(error_body(CUT_SHORT[event.finish_reason], "server_error"))
            if include_usage:
                yield sse(usage_chunk(meta, usage(event.prompt_tokens, event.completion_tokens)))
            yield "data: [DONE]\n\n"
            return
    finally:
        watcher.cancel()
        job.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def gather(job: Job, events: asyncio.Queue, meta: Meta, request: Request) -> JSONResponse:
    """The job's whole answer. A client that hangs up before it ends cancels the job."""
    pieces, watcher = [], asyncio.create_task(until_gone(request, job))
    try:
        while True:
            event = await events.get()  # the engine ends every job, cancelled ones too
            if isinstance(event, Piece):
                pieces.append(event.text)
                continue
            if job.cancelled.is_set():  # by until_gone: nobody reads this
                return JSONResponse(error_body("the client went away"), status_code=499)
            if event.finish_reason not in ("stop", "length"):
                raise APIError(503, CUT_SHORT[event.finish_reason], type="server_error")
            return JSONResponse(answer(meta, "".join(pieces), event.finish_reason,
                                       usage(event.prompt_tokens, event.completion_tokens)))
    finally:
        watcher.cancel()
        job.cancel()


class ApiKey:
    """With --api-key, every /v1/ request shows it, before its body is even read: 401 in
    OpenAI's shape otherwise. A plain ASGI middleware, as BodyLimit is: behind Starlette's
    @app.middleware("http"), which runs the route on a channel of its own, a route's
    request.is_disconnected() never saw its client hang up."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is not None and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            shown = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(shown, f"Bearer {self.key}".encode()):  # constant time
                body = json.dumps(error_body(
                    "a wrong or missing API key: send the server's --api-key as "
                    "'Authorization: Bearer KEY'", code="invalid_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                return await send({"type": "http.response.body", "body": body})
        await self.app(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="gptlab", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=1 << 20)
    app.add_middleware(ApiKey, key=service.api_key)  # the outer one: a key before a body
    add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await respond(service, request, body, chat_job, Meta("chat.completion", service.name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(service, request, body, completion_job,
                             Meta("text_completion", service.name))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model",
                                            "created": service.created, "owned_by": "gptlab"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.name, **service.engine.load()}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE.read_text()

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape: FastAPI's own (bad JSON, a field of the wrong
    type, a route that is not there) as well as this server's."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        what = str(first.get("msg", "is invalid")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message, where = "the body is not valid JSON; send a JSON object", []
        else:
            message = f"{'.'.join(where)}: {what}" if where else what
        return JSONResponse(error_body(message, param=where[0] if where else None),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = str(e.detail)
        if e.status_code in (404, 405):
            message = (f"{request.method} {request.url.path} is not an endpoint of this "
                       f"server; see /v1/chat/completions, /v1/completions, /v1/models")
        return JSONResponse(error_body(message), status_code=e.status_code,
                            headers=getattr(e, "headers", None))
