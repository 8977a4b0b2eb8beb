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
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from data.tokenizer import Tokenizer
from generate import TextStream
from measure.logprobs import Scored
from serving.api import (
    APIError,
    Logprob,
    Logprobs,
    Meta,
    answer,
    choice,
    chunk,
    error_body,
    role_chunk,
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
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens by id


class Offsets:
    """Where each token's text starts in its choice's text (a completion's text_offset):
    the characters that the tokens before it complete. The tokens that share a character
    start where it does, and a special token that the text leaves out takes no room, so
    that an offset always points into the text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer, self.at = tokenizer, 0
        self.text = TextStream(tokenizer, skip_special_tokens)  # as the generated text's

    def prompt(self, ids: list[int], text: str) -> list[int]:
        """The echoed prompt's tokens, whose text is decoded whole, special tokens kept."""
        start = self.at
        starts = self.advance(TextStream(self.tokenizer, skip_special_tokens=False), ids)
        self.at = start + len(text)  # the prompt's text itself, its unfinished bytes included
        return starts

    def generated(self, ids: list[int]) -> list[int]:
        return self.advance(self.text, ids)

    def advance(self, text: TextStream, ids: list[int]) -> list[int]:
        starts = []
        for token in ids:
            starts.append(self.at)
            self.at += len(text.push([token]))
        return starts


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
        self.logprobs = (None if work.alternatives is None
                         else Logprobs(tokenizer, self.chat, work.token_ids))

    def prompt_text(self, i: int) -> str:
        """What an echo puts first in choice i: its prompt's text (nothing without echo)."""
        return self.tokenizer.decode(self.work.prompts[i]) if self.work.echo else ""

    def offsets(self) -> Offsets:
        return Offsets(self.tokenizer, self.work.sampling.skip_special_tokens)

    def prompt_tokens(self, i: int, scored: list[Scored] | None,
                      offsets: Offsets) -> tuple[list[Logprob], list[int]]:
        """Choice i's echoed prompt tokens with their logprobs (the first None), and where
        each one's text starts; none where logprobs are not asked for."""
        if scored is None:
            return [], []
        ids, s = self.work.prompts[i], scored[i]
        tokens = [Logprob(t, s.logprobs[j], tuple(s.top[j])) for j, t in enumerate(ids)]
        return tokens, offsets.prompt(ids, self.prompt_text(i))

    def piece_tokens(self, piece: Piece, offsets: Offsets) -> tuple[list[Logprob], list[int]]:
        """The tokens a piece completes, with their logprobs, and where each text starts."""
        if self.logprobs is None:
            return [], []
        tokens = [Logprob(t.id, t.logprob, t.top) for t in piece.tokens]
        return tokens, offsets.generated([t.id for t in tokens])

    def shape(self, tokens: list[Logprob], starts: list[int]) -> dict | None:
        return None if self.logprobs is None else self.logprobs.shape(tokens, starts)

    async def next_event(self) -> tuple[int, Piece | Done | list]:
        index, event = await self.events.get()
        if isinstance(event, Exception):
            raise APIError(503, CUT_SHORT["error"], type="server_error")
        return index, event

    async def scored_prompts(self) -> list[Scored] | None:
        """The echoed prompts' scores, where logprobs ask for them; the engine delivers
        them before any token (an event of index -1), and what comes first waits."""
        if not self.work.echo or self.work.alternatives is None:
            return None
        parked = []
        while True:
            index, event = await self.next_event()
            if index == -1:
                for item in parked:
                    self.events.put_nowait(item)
                return event
            parked.append((index, event))

    def echo_only(self) -> dict[int, Done]:
        """The ends of the choices when nothing is generated (an echo with max_tokens 0)."""
        if self.work.sampling.max_tokens:
            return {}
        return {i: Done("length", len(ids), 0) for i, ids in enumerate(self.work.prompts)}

    async def whole(self, request: Request) -> Response:
        """The whole answer. A client that hangs up before it ends cancels its jobs."""
        watcher = asyncio.create_task(until_gone(request, self.jobs))
        try:
            scored = await self.scored_prompts()
            pieces: list[list[Piece]] = [[] for _ in self.work.prompts]
            done = self.echo_only()
            while len(done) < len(self.work.prompts):
                index, event = await self.next_event()
                if isinstance(event, Piece):
                    pieces[index].append(event)
                    continue
                if watcher.done():  # the client went away, and until_gone cancelled the jobs
                    return JSONResponse(error_body("the client went away"), status_code=499)
                if event.finish_reason not in ("stop", "length"):
                    raise APIError(503, CUT_SHORT[event.finish_reason], type="server_error")
                done[index] = event
            # many prompts echoed with their logprobs make a large answer: it is written in
            # a thread, so that the event loop goes on serving every other request
            return await run_in_threadpool(self.written, scored, pieces, done)
        finally:
            watcher.cancel()
            for job in self.jobs:
                job.cancel()

    def written(self, scored: list[Scored] | None, pieces: list[list[Piece]],
                done: dict[int, Done]) -> Response:
        """The whole answer of the prompts' scores and the pieces each choice received."""
        choices = []
        for i, received in enumerate(pieces):
            offsets = self.offsets()
            tokens, starts = self.prompt_tokens(i, scored, offsets)
            for piece in received:
                more, more_starts = self.piece_tokens(piece, offsets)
                tokens += more
                starts += more_starts
            text = self.prompt_text(i) + "".join(piece.text for piece in received)
            choices.append(choice(self.meta, text, done[i].finish_reason, delta=False, index=i,
                                  logprobs=self.shape(tokens, starts)))
        return Response(answer(self.meta, choices, self.usage(done)),
                        media_type="application/json")

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
            offsets = [self.offsets() for _ in self.work.prompts]
            scored = await self.scored_prompts()
            for i in range(len(self.work.prompts) if self.work.echo else 0):
                yield sse(chunk(meta, self.prompt_text(i), index=i,
                                logprobs=self.shape(*self.prompt_tokens(i, scored, offsets[i]))))
            done = self.echo_only()
            for i in done:
                yield sse(chunk(meta, None, "length", index=i))
            while len(done) < len(self.work.prompts):
                index, event = await self.next_event()
                if isinstance(event, Piece):
                    logprobs = self.shape(*self.piece_tokens(event, offsets[index]))
                    yield sse(chunk(meta, event.text, index=index, logprobs=logprobs))
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
