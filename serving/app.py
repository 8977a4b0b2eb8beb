"""The HTTP side: OpenAI's endpoints and the chat page, a thin shell over one Engine.

Usage:
    app = create_app(Service(engine, tokenizer, "chat_sft", block_size=1024, max_tokens=500,
                             temperature=0.8))
    uvicorn.Server(uvicorn.Config(app)).run()        # serve.py does this

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events
with "stream": true), GET /v1/models; vLLM's POST /tokenize and /detokenize and GET
/tokenizer_info, which lm-eval's remote tokenizer reads; GET /health and /metrics
(Prometheus's text format); and / (serving/chat.html). Every error is a 4xx in OpenAI's
shape (serving/api.py), never a traceback: bad JSON and bad fields 400, a wrong or missing
key 401 (with --api-key), an unknown model 404, a body over 1 MB 413, a full queue 429 with
Retry-After. A client that hangs up cancels its request (serving/answer.py); the API key
is checked by a plain ASGI middleware (ApiKey), which leaves the disconnect visible.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from data.chat import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    CHAT_TEMPLATE,
    ConversationError,
    check_conversation,
    render_prompt,
    special_ids,
)
from data.text import check_text
from data.tokenizer import Tokenizer
from generate import prompt_ids
from serving.answer import Answer, Work
from serving.api import (
    APIError,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Meta,
    TokenizeRequest,
    error_body,
)
from serving.engine import Done, Engine, Job, Piece, QueueFull, Sampling, Scoring
from serving.limits import BodyLimit

PAGE = Path(__file__).with_name("chat.html")


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
                 prompt_field: str, echo: bool = False) -> Sampling:
        """The request's sampling, the defaults filling what it leaves out; a request that
        cannot fit in the context is refused by name (an echo that generates nothing may
        fill it: the last token is scored, never fed)."""
        room = self.block_size - prompt_len
        if echo and max_tokens == 0 and room >= -1:
            return Sampling(max_tokens=0, logprobs=body.alternatives)
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
                        skip_special_tokens=body.skip_special_tokens,
                        logprobs=body.alternatives)

    def check_model(self, body: BaseRequest) -> None:
        if body.model not in (None, self.name):
            raise APIError(404, f"the model {body.model!r} is not served here; this server "
                                f"serves {self.name!r} (GET /v1/models)", "model",
                           "model_not_found")


def given(value: object, default: object) -> object:
    """A request's value, or the server's default where the request leaves it out."""
    return default if value is None else value


def chat_work(service: Service, body: ChatRequest) -> Work:
    """A chat request: the messages rendered as the chat REPL renders them."""
    try:
        ends = {special_ids(service.tokenizer)[ASSISTANT_END]}
        turns = check_conversation(body.messages, ends_with="user")
        ids = render_prompt(service.tokenizer, turns)
    except ConversationError as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    except ValueError as e:  # a base model's tokenizer, a character the vocabulary lacks
        raise APIError(400, str(e), "messages") from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    return Work([ids], service.sampling(body, len(ids), max_tokens, "messages"), ends,
                body.alternatives)


def completion_work(service: Service, body: CompletionRequest) -> Work:
    """A completion request: each prompt continued as sample.py --prompt continues one,
    or taken as the token ids it is."""
    vocab, prompts = service.tokenizer.vocab_size, []
    for i, prompt in enumerate(body.prompts):
        where = "prompt" if len(body.prompts) == 1 else f"prompt {i}"
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None or not prompt:
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary of "
                                    f"{vocab:,}" if prompt else f"{where} has no tokens", "prompt")
            prompts.append(prompt)
            continue
        try:
            prompts.append(prompt_ids(service.tokenizer, prompt))
        except ValueError as e:
            raise APIError(400, f"{where}: {e}" if len(body.prompts) > 1 else str(e),
                           "prompt") from None
    longest = max(len(ids) for ids in prompts)
    eot = service.tokenizer.eot_token
    sampling = service.sampling(body, longest, body.max_tokens, "prompt", echo=body.echo)
    return Work(prompts, sampling, set() if eot is None else {eot}, body.alternatives,
                body.echo)


async def respond(service: Service, request: Request, body: BaseRequest, work: Work,
                  meta: Meta) -> JSONResponse | StreamingResponse:
    """Submit the request's sequences (and the scoring of an echoed prompt's logprobs),
    then stream their events or gather them into one answer."""
    service.check_model(body)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(index: int) -> Callable:
        def put(event: Piece | Done | list | Exception) -> None:  # from the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the loop has closed: the server is gone
                pass
        return put

    ends = set() if body.ignore_eos else work.ends
    answers = [Job(ids, work.sampling, ends, deliver(i), service.tokenizer,
                   reuse=body.cache_prompt)
               for i, ids in enumerate(work.prompts)] if work.sampling.max_tokens else []
    jobs: list[Job | Scoring] = list(answers)  # what a client's hang-up cancels
    submitted = list(answers)
    if work.echo and work.alternatives is not None:
        # an echo and one token (lm-eval's loglikelihood): the token comes from the pass
        # that scores the prompt, which prefills nothing; more tokens decode in slots
        first = answers if work.sampling.max_tokens == 1 else []
        scoring = Scoring(work.prompts, work.alternatives, deliver(-1), first)
        submitted = [scoring] if first else [scoring, *answers]
        jobs.append(scoring)
    try:
        for job in submitted:
            service.engine.submit(job)
    except QueueFull as e:
        for job in jobs:
            job.cancel()
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    answer_ = Answer(service.tokenizer, work, meta, events, jobs)
    if body.stream:
        return StreamingResponse(answer_.stream(body.include_usage, request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await answer_.whole(request)


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
        return await respond(service, request, body, chat_work(service, body),
                             Meta("chat.completion", service.name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(service, request, body, completion_work(service, body),
                             Meta("text_completion", service.name))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model",
                                            "created": service.created, "owned_by": "gptlab"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.name, **service.engine.load()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(service.name, service.engine.load()),
                                 media_type="text/plain; version=0.0.4")

    # the tokenizer's own endpoints, as vLLM names them: lm-eval's local-completions uses
    # them to tokenize as the server does, with no tokenizer of its own
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = encode_specials(service.tokenizer, check_text(body.prompt, "prompt"))
        return {"count": len(ids), "max_model_len": service.block_size, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = service.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary of {vocab:,}", "tokens")
        return {"prompt": service.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_description(service.tokenizer, service.block_size)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE.read_text()

    return app


def encode_specials(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of text in which a special token spelled out ("<|endoftext|>") is that token,
    as Hugging Face's tokenizers read text, and vLLM's /tokenize: what lm-eval's remote
    tokenizer expects of a special token's name. A completion's prompt never reads text so."""
    if not tokenizer.specials:
        return tokenizer.encode(text)
    names = sorted(tokenizer.specials, key=len, reverse=True)
    ids, at = [], 0
    for match in re.finditer("|".join(map(re.escape, names)), text):
        ids += tokenizer.encode(text[at:match.start()]) if match.start() > at else []
        ids.append(tokenizer.specials[match.group()])
        at = match.end()
    return ids + (tokenizer.encode(text[at:]) if at < len(text) else [])


def tokenizer_description(tokenizer: Tokenizer, block_size: int) -> dict:
    """/tokenizer_info: vLLM's fields that lm-eval reads (eos_token, bos_token,
    chat_template), and the context."""
    eos = tokenizer.decode([tokenizer.eot_token]) if tokenizer.eot_token is not None else None
    chat = ASSISTANT_START in tokenizer.specials
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": eos,
            "bos_token": BOS if BOS in tokenizer.specials else eos, "pad_token": None,
            "model_max_length": block_size, "chat_template": CHAT_TEMPLATE if chat else None}


METRICS = {  # name -> (/health's key, type, help)
    "prompt_tokens_total": ("prompt_tokens", "counter", "Prompt tokens of the requests taken."),
    "prompt_tokens_reused_total": ("prompt_tokens_reused", "counter",
                                   "Prompt tokens found in a slot's cache, not prefilled again."),
    "prompt_tokens_prefilled_total": ("prompt_tokens_prefilled", "counter",
                                      "Prompt tokens prefilled."),
    "generation_tokens_total": ("tokens", "counter", "Tokens generated."),
    "num_requests_running": ("active", "gauge", "Sequences in a slot."),
    "num_requests_waiting": ("waiting", "gauge", "Requests waiting for a slot."),
}


def prometheus(model: str, load: dict[str, int]) -> str:
    """/metrics in Prometheus's text format, named as vLLM names its own (gptlab: for vllm:)."""
    lines = []
    for name, (key, kind, help) in METRICS.items():
        lines += [f"# HELP gptlab:{name} {help}", f"# TYPE gptlab:{name} {kind}",
                  f'gptlab:{name}{{model_name="{model}"}} {load[key]}']
    return "\n".join(lines) + "\n"


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
