"""A request's side of the engine: the work it asks for (Work), and what comes back turned
into OpenAI's answer (Answer), whole or as server-sent events. A client that hangs up
cancels its work, streamed or not, waiting or running: a task beside the answer waits for
the disconnect (`until_gone`).

Usage:
    work = Work(prompts=[ids], sampling=sampling, ends={eot}, alternatives=None)
    answer = Answer(tokenizer, work, meta, events, jobs)   # events: (index, Piece | Done)
    return await answer.whole(request)                     # or: answer.stream(usage, request)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from data.tokenizer import Tokenizer
from serving.api import (
    APIError,
    Logprob,
    Meta,
    answer,
    chat_logprobs,
    choice,
    chunk,
    error_body,
    role_chunk,
    text_logprobs,
    usage,
    usage_chunk,
)
from serving.engine import Done, Job, Piece, Sampling, Scoring

CUT_SHORT = {  # what a client hears of an answer that the engine ended early
    "cancelled": "the server is stopping and cut this answer short; try again once it is back",
    "error": "the server failed while answering (its log has the traceback); try again",
}


@dataclass
class Work:
    """A request, ready for the engine: each prompt's ids (one sequence each), how they
    sample, the tokens that end them, and what comes back besides their text."""
    prompts: list[list[int]]
    sampling: Sampling
    ends: set[int]
    alternatives: int | None  # logprobs of each token: None, or how many alternatives
    echo: bool = False  # the prompt's text first, and with logprobs its tokens' logprobs


async def until_gone(request: Request, jobs: list[Job | Scoring]) -> None:
    """Cancel the jobs once their client hangs up. Run as a task beside the one that waits
    for their events: ASGI says a disconnect by the next message of `receive` (the body has
    been read), which comes at once, whether tokens flow or the jobs still wait."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel()


class Answer:
    """A request's events as its answer: whole, or as server-sent events."""

    def __init__(self, tokenizer: Tokenizer, work: Work, meta: Meta, events: asyncio.Queue,
                 jobs: list[Job | Scoring]) -> None:
        self.tokenizer, self.work, self.meta, self.events, self.jobs = tokenizer, work, meta, events, jobs
        self.chat = meta.object == "chat.completion"

    def echoed(self, scored: list | None) -> list[tuple[str, list[Logprob]]]:
        """Each prompt's text, and its tokens' logprobs (the first None) where asked."""
        out = []
        for i, ids in enumerate(self.work.prompts):
            tokens = [] if scored is None else [
                Logprob(self.token_text(t), lp, None if j == 0 else self.top(scored[i].top[j]))
                for j, (t, lp) in enumerate(zip(ids, scored[i].logprobs, strict=True))]
            out.append((self.tokenizer.decode(ids), tokens))
        return out

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def top(self, alternatives) -> dict[str, float]:
        return {self.token_text(t): lp for t, lp in alternatives}

    def generated(self, piece: Piece) -> list[Logprob]:
        return [Logprob(self.token_text(t.id), t.logprob, self.top(t.top)) for t in piece.tokens]

    def logprobs(self, tokens: list[Logprob], offset: int = 0) -> dict | None:
        if self.work.alternatives is None:
            return None
        return chat_logprobs(tokens) if self.chat else text_logprobs(tokens, offset)

    async def next_event(self) -> tuple[int, Piece | Done | list]:
        index, event = await self.events.get()
        if isinstance(event, Exception):
            raise APIError(503, CUT_SHORT["error"], type="server_error")
        return index, event

    async def prompts_scored(self) -> list[tuple[str, list[Logprob]]]:
        """What an echo puts first in each choice: the prompts' texts, and their logprobs
        once the engine has scored them (nothing comes before that)."""
        if not self.work.echo:
            return [("", []) for _ in self.work.prompts]
        if self.work.alternatives is None:
            return self.echoed(None)
        parked = []
        while True:
            index, event = await self.next_event()
            if index == -1:
                for item in parked:
                    self.events.put_nowait(item)
                return self.echoed(event)
            parked.append((index, event))

    async def whole(self, request: Request) -> JSONResponse:
        """The whole answer. A client that hangs up before it ends cancels its jobs."""
        watcher = asyncio.create_task(until_gone(request, self.jobs))
        try:
            echo = await self.prompts_scored()
            n = len(self.work.prompts)
            texts = [[text] for text, _ in echo]
            tokens = [list(lps) for _, lps in echo]
            done: dict[int, Done] = {}
            if not self.work.sampling.max_tokens:  # the echo alone
                done = {i: Done("length", len(ids), 0) for i, ids in enumerate(self.work.prompts)}
            while len(done) < n:
                index, event = await self.next_event()
                if isinstance(event, Piece):
                    texts[index].append(event.text)
                    tokens[index] += self.generated(event)
                    continue
                if any(job.cancelled.is_set() for job in self.jobs):  # by until_gone
                    return JSONResponse(error_body("the client went away"), status_code=499)
                if event.finish_reason not in ("stop", "length"):
                    raise APIError(503, CUT_SHORT[event.finish_reason], type="server_error")
                done[index] = event
            choices = [choice(self.meta, "".join(texts[i]), done[i].finish_reason, delta=False,
                              index=i, logprobs=self.logprobs(tokens[i])) for i in range(n)]
            return JSONResponse(answer(self.meta, choices, self.usage(done)))
        finally:
            watcher.cancel()
            for job in self.jobs:
                job.cancel()

    def usage(self, done: dict[int, Done]) -> dict:
        return usage(sum(len(ids) for ids in self.work.prompts),
                     sum(d.completion_tokens for d in done.values()))

    async def stream(self, include_usage: bool, request: Request) -> AsyncIterator[str]:
        """The events as server-sent events, ending with data: [DONE]. A client that hangs
        up cancels the jobs, which frees their slots or their places in the queue."""
        watcher = asyncio.create_task(until_gone(request, self.jobs))
        meta = self.meta
        try:
            if self.chat:
                yield sse(role_chunk(meta))
            offsets = []
            for i, (text, lps) in enumerate(await self.prompts_scored()):
                if text:
                    yield sse(chunk(meta, text, index=i, logprobs=self.logprobs(lps)))
                offsets.append(len(text))
            n, done = len(self.work.prompts), {}
            if not self.work.sampling.max_tokens:
                done = {i: Done("length", len(ids), 0) for i, ids in enumerate(self.work.prompts)}
                for i in done:
                    yield sse(chunk(meta, None, "length", index=i))
            while len(done) < n:
                index, event = await self.next_event()
                if isinstance(event, Piece):
                    lps = self.generated(event)
                    yield sse(chunk(meta, event.text, index=index,
                                    logprobs=self.logprobs(lps, offsets[index])))
                    offsets[index] += len(event.text)
                    continue
                done[index] = event
                if event.finish_reason in ("stop", "length"):
                    yield sse(chunk(meta, None, event.finish_reason, index=index))
                else:  # headers are sent: an error can only be an event of its own
                    yield sse(error_body(CUT_SHORT[event.finish_reason], "server_error"))
                    break
            if include_usage:
                yield sse(usage_chunk(meta, self.usage(done)))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for job in self.jobs:
                job.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
