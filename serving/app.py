"""The HTTP side: OpenAI's endpoints and the chat page, a thin shell over one Engine.

Usage:
    app = create_app(Service(engine, tokenizer, "chat_sft", block_size=1024, max_tokens=500,
                             temperature=0.8))
    uvicorn.Server(uvicorn.Config(app)).run()        # serve.py does this

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events
with "stream": true), GET /v1/models; vLLM's POST /tokenize and /detokenize and GET
/tokenizer_info, which lm-eval's remote tokenizer reads; GET /health and /metrics
(Prometheus's text format); and / (serving/chat.html). Every error comes in OpenAI's shape
(serving/api.py), never a traceback, on every route: a body that is not strict JSON
(serving/body.py) and bad fields 400, a wrong or missing key 401 (with --api-key, on every
route but OPEN), an unknown model 404, a body over 1 MB 413, a full queue 429 with
Retry-After. A client that hangs up cancels its
request (serving/answer.py); the API key is checked by a plain ASGI middleware (ApiKey),
which leaves the disconnect visible. Work that grows with a request's body (tokenizing,
writing a large answer) runs in a thread, so that one large request holds no other back.
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
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.concurrency import run_in_threadpool
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
from data.tokenizer import Tokenizer
from generate import prompt_ids
from machine.errors import InputError
from serving.answer import Answer, Work
from serving.api import (
    APIError,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Meta,
    TokenizeRequest,
    dumps,
    error_body,
    json_object,
    refusal,
)
from serving.body import NotJSON, StrictJSONRoute
from serving.engine import Done, Engine, Job, Piece, QueueFull, Sampling, Scoring
from serving.limits import BodyLimit

PAGE = Path(__file__).with_name("chat.html")
# what --api-key leaves open, as vLLM does: the page (which asks for the key), and the load
# that monitoring reads; every route that computes on a request's body needs the key
OPEN = frozenset({("GET", "/"), ("GET", "/health"), ("GET", "/metrics")})
IDS_A_CALL = 1 << 15  # token ids that one json.dumps call writes (json_object says why)


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
        fill it, because its last token is scored, never fed)."""
        room = self.block_size - prompt_len
        if echo and max_tokens == 0:
            if room < -1:
                raise APIError(400, f"the prompt takes {prompt_len} tokens, and an echo scores "
                                    f"at most {self.block_size + 1} (the model's context of "
                                    f"{self.block_size}, and the token after it); shorten it",
                               prompt_field, "context_length_exceeded")
            return Sampling(max_tokens=0, logprobs=self.alternatives(body))
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
                        logprobs=self.alternatives(body))

    def alternatives(self, body: BaseRequest) -> int | None:
        """The alternatives asked of each token, None for no logprobs, at most the whole
        vocabulary (a character table may hold fewer tokens than a request asks for)."""
        asked = body.alternatives
        return None if asked is None else min(asked, self.tokenizer.vocab_size)

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
    sampling = service.sampling(body, len(ids), max_tokens, "messages")
    return Work([ids], sampling, ends, sampling.logprobs, token_ids=body.return_tokens_as_token_ids)


def completion_work(service: Service, body: CompletionRequest) -> Work:
    """A completion request: each prompt continued as sample.py --prompt continues one,
    or taken as the token ids it is."""
    prompts = []
    for i, prompt in enumerate(body.prompts):
        where = "prompt" if len(body.prompts) == 1 else f"prompt {i}"
        if isinstance(prompt, list):
            if not prompt:
                raise APIError(400, f"{where} has no tokens; send at least one", "prompt")
            prompts.append(check_ids(service.tokenizer, prompt, where, "prompt"))
            continue
        try:
            prompts.append(prompt_ids(service.tokenizer, prompt))
        except ValueError as e:
            raise APIError(400, f"{where}: {e}" if len(body.prompts) > 1 else str(e),
                           "prompt") from None
    longest = max(len(ids) for ids in prompts)
    eot = service.tokenizer.eot_token
    sampling = service.sampling(body, longest, body.max_tokens, "prompt", echo=body.echo)
    return Work(prompts, sampling, set() if eot is None else {eot}, sampling.logprobs,
                body.echo, body.return_tokens_as_token_ids)


async def respond(service: Service, request: Request, body: BaseRequest,
                  work_of: Callable[[Service, BaseRequest], Work],
                  meta: Meta) -> Response | StreamingResponse:
    """Tokenize the request, submit its sequences (and the scoring of an echoed prompt's
    logprobs), then stream their events or gather them into one answer. The first two run
    in a thread, because a long text to tokenize, or the thousands of jobs of one request
    of lm-eval's, would otherwise hold the event loop and every other request with it."""
    service.check_model(body)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(index: int) -> Callable:
        def put(event: Piece | Done | list | Exception) -> None:  # from the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the loop has closed, because the server is gone
                pass
        return put

    def start() -> tuple[Work, list[Job | Scoring]]:
        work = work_of(service, body)
        return work, submit(service, body, work, deliver)

    work, jobs = await run_in_threadpool(start)
    answer_ = Answer(service.tokenizer, work, meta, events, jobs)
    if body.stream:
        return StreamingResponse(answer_.stream(body.include_usage, request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await answer_.whole(request)


def submit(service: Service, body: BaseRequest, work: Work,
           deliver: Callable[[int], Callable]) -> list[Job | Scoring]:
    """Give the engine a job per prompt that generates, and a Scoring where an echo asks
    for the prompt's logprobs; what a client's hang-up cancels. 429 when the queue is full."""
    ends = set() if body.ignore_eos else work.ends
    answers = [Job(ids, work.sampling, ends, deliver(i), service.tokenizer,
                   reuse=body.cache_prompt)
               for i, ids in enumerate(work.prompts)] if work.sampling.max_tokens else []
    jobs: list[Job | Scoring] = list(answers)
    submitted = list(answers)
    if work.echo and work.alternatives is not None:
        # an echo and one token (lm-eval's loglikelihood): the token comes from the pass
        # that scores the prompt, which prefills nothing; more tokens decode in slots
        first = answers if work.sampling.max_tokens == 1 else []
        scoring = Scoring(work.prompts, work.alternatives, deliver(-1), first)
        submitted = [scoring] if first else [scoring, *answers]
        jobs.append(scoring)
    check_capacity(service.engine, submitted)
    try:
        for job in submitted:
            service.engine.submit(job)
    except QueueFull as e:
        for job in jobs:
            job.cancel()
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    return jobs


def check_capacity(engine: Engine, submitted: list[Job | Scoring]) -> None:
    """Refuse a request of more prompts than the slots and the queue hold together: it
    could never be taken whole, and a 429 would have its client retry it forever."""
    prompts = sum(isinstance(work, Job) for work in submitted)
    most = engine.slots + engine.queue_size - (len(submitted) - prompts)  # a Scoring waits too
    if prompts > most:
        raise APIError(400, f"prompt holds {prompts} prompts, and this server takes at most "
                            f"{most} at once ({engine.slots} slots and a queue of "
                            f"{engine.queue_size}); send them in smaller requests", "prompt")


class ApiKey:
    """With --api-key, every request but those OPEN names shows it, before its body is even
    read, or gets a 401 in OpenAI's shape. This is a plain ASGI middleware, as BodyLimit is,
    because Starlette's @app.middleware("http") runs the route on a channel of its own, where
    the route would never see its client hang up."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.key is not None and scope["type"] == "http"
                and (scope["method"], scope["path"]) not in OPEN):
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
    app.router.route_class = StrictJSONRoute  # every body is read as strict JSON, in one place
    app.add_middleware(BodyLimit, limit=1 << 20)
    app.add_middleware(ApiKey, key=service.api_key)  # added last, so it checks the key before any body
    add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await respond(service, request, body, chat_work,
                             Meta("chat.completion", service.name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(service, request, body, completion_work,
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
    # them to tokenize as the server does, with no tokenizer of its own. They run in a thread,
    # because a large body takes the CPU long enough to hold back every other request
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await run_in_threadpool(tokenized, service, body.prompt)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await run_in_threadpool(detokenized, service, body.tokens)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_description(service.tokenizer, service.block_size)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE.read_text()

    return app


def tokenized(service: Service, text: str) -> Response:
    """/tokenize's answer, written here because FastAPI's own encoder walks a list item by item."""
    ids = encode_specials(service.tokenizer, text)
    runs = (dumps(ids[i:i + IDS_A_CALL])[1:-1] for i in range(0, len(ids), IDS_A_CALL))
    return Response(json_object({"count": len(ids), "max_model_len": service.block_size},
                                "tokens", runs), media_type="application/json")


def detokenized(service: Service, tokens: list[int]) -> JSONResponse:
    ids = check_ids(service.tokenizer, tokens, "tokens", "tokens")
    return JSONResponse({"prompt": service.tokenizer.decode(ids)})


def check_ids(tokenizer: Tokenizer, ids: list[int], where: str, param: str) -> list[int]:
    """The ids, if each is in the vocabulary; a 400 naming the first that is not, where."""
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{where}: token id {bad} is outside the vocabulary of {vocab:,}; "
                            f"send ids from 0 to {vocab - 1:,}", param)
    return ids


def encode_specials(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of text in which a special token spelled out ("<|endoftext|>") is that token,
    as Hugging Face's tokenizers and vLLM's /tokenize read it, and as lm-eval's remote
    tokenizer expects. A completion's prompt is never read this way."""
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
    lines, labels = [], f'{{model_name="{label_value(model)}"}}'
    for name, (key, kind, help) in METRICS.items():
        lines += [f"# HELP gptlab:{name} {help}", f"# TYPE gptlab:{name} {kind}",
                  f"gptlab:{name}{labels} {load[key]}"]
    return "\n".join(lines) + "\n"


def label_value(text: str) -> str:
    """A label's value as the text format writes it: a backslash, a double quote and a
    line feed escaped, which would otherwise end the value or the line (a model is named
    after its file, and a file's name may hold any of them)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape, on every route: FastAPI's own (bad JSON, a
    field of the wrong type, a route that is not there), this server's, and a user's input
    that a layer below refused (InputError: text that is not text, a value out of range)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(InputError)
    async def input_error(request: Request, e: InputError):
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        message, param = refusal(e.errors(), e.body)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = str(e.detail)
        if e.status_code in (404, 405):
            message = (f"{request.method} {request.url.path} is not an endpoint of this "
                       f"server; see /v1/chat/completions, /v1/completions, /v1/models")
        param = None
        if e.status_code == 400 and isinstance(e.__cause__, NotJSON):  # serving/body.py's
            message, param = str(e.__cause__), e.__cause__.param
        elif e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not read the body
            message = f"the body cannot be read ({type(e.__cause__).__name__}); send a JSON object"
        return JSONResponse(error_body(message, param=param), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception):
        # a bug: the client gets OpenAI's shape, and the log the traceback (Starlette
        # raises the exception again once this answer is sent)
        return JSONResponse(error_body("the server failed on this request (its log has the "
                                       "traceback)", "server_error"), status_code=500)

