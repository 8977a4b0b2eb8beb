"""A request's side of the engine: the work it asks for (Work), and the engine's events
turned into OpenAI's answer (Answer), whole or as server-sent events. A client that hangs up
cancels its work, streamed or not, waiting or running, because a task beside the answer
waits for the disconnect (`until_gone`).

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

from data.text import TextStream
from data.tokenizer import Tokenizer
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

CUT_SHORT = {  # what the client is told when the engine ends its answer early
    "cancelled": "the server is stopping and cut this answer short; try again once it is back",
    "error": "the server failed while answering (its log has the traceback); try again",
}


@dataclass
class Work:
    """A request ready for the engine: each prompt's ids (one sequence per prompt), how the
    sequences sample, the tokens that end them, and what comes back besides their text."""
    prompts: list[list[int]]
    sampling: Sampling
    ends: set[int]
    alternatives: int | None  # per-token logprobs: None, or how many alternatives
    echo: bool = False  # the prompt's text comes first (with logprobs, its tokens' logprobs too)
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids; logprobs name tokens by id


class Offsets:
    """Where each token's text starts in its choice's text (a completion's text_offset),
    counted in the characters that the tokens before it complete. Tokens that share a
    character start where that character does, and a special token left out of the text
    takes no room, so that an offset always points into the text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer, self.at = tokenizer, 0
        self.text = TextStream(tokenizer, skip_special_tokens)  # decoded as the answer's text is

    def prompt(self, ids: list[int], text: str) -> list[int]:
        """The offsets of the echoed prompt's tokens, whose text is decoded whole, with
        special tokens kept."""
        start = self.at
        starts = self.advance(TextStream(self.tokenizer, skip_special_tokens=False), ids)
        self.at = start + len(text)  # the prompt's own text, unfinished bytes included
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
    """Cancel the jobs once their client hangs up. This runs as a task beside the one that
    waits for the jobs' events. Once the body has been read, ASGI reports a disconnect as
    the next message from `receive`, which arrives at once, whether tokens are flowing or
    the jobs are still waiting."""
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
        """The text an echo puts first in choice i: its prompt's text, or nothing without echo."""
        return self.tokenizer.decode(self.work.prompts[i]) if self.work.echo else ""

    def offsets(self) -> Offsets:
        return Offsets(self.tokenizer, self.work.sampling.skip_special_tokens)

    def prompt_tokens(self, i: int, scored: list[Scored] | None,
                      offsets: Offsets) -> tuple[list[Logprob], list[int]]:
        """Choice i's echoed prompt tokens with their logprobs (the first is None), and where
        each token's text starts; nothing when logprobs are not asked for."""
        if scored is None:
            return [], []
        ids, s = self.work.prompts[i], scored[i]
        tokens = [Logprob(t, s.logprobs[j], tuple(s.top[j])) for j, t in enumerate(ids)]
        return tokens, offsets.prompt(ids, self.prompt_text(i))

    def piece_tokens(self, piece: Piece, offsets: Offsets) -> tuple[list[Logprob], list[int]]:
        """The tokens a piece completes, with their logprobs, and where each one's text starts."""
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
        """The echoed prompts' scores, when logprobs ask for them. The engine delivers them
        (as an event of index -1) before any token; an event that still arrives first is
        parked and put back."""
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
        """The end of every choice when nothing is generated (an echo with max_tokens 0)."""
        if self.work.sampling.max_tokens:
            return {}
        return {i: Done("length", len(ids), 0) for i, ids in enumerate(self.work.prompts)}

    async def whole(self, request: Request) -> Response:
        """The whole answer. A client that hangs up before the answer ends cancels its jobs."""
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
            # Many prompts echoed with their logprobs make a large answer, so it is written
            # in a thread while the event loop goes on serving every other request.
            return await run_in_threadpool(self.written, scored, pieces, done)
        finally:
            watcher.cancel()
            for job in self.jobs:
                job.cancel()

    def written(self, scored: list[Scored] | None, pieces: list[list[Piece]],
                done: dict[int, Done]) -> Response:
        """The whole answer, from the prompts' scores and the pieces each choice received."""
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
                else:  # the headers are already sent, so an error must be an event of its own
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
