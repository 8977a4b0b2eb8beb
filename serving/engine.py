"""Continuous batching: many requests decoded together, one batched step for all of them.

Usage:
    engine = Engine(model, tokenizer, slots=16, queue=64)
    threading.Thread(target=engine.run).start()   # serve.py runs it in the main thread
    job = Job(ids, Sampling(max_tokens=64, temperature=0.0), ends={eot}, deliver=callback)
    engine.submit(job)        # QueueFull when the queue is full; deliver() gets Piece, Done
    job.cancel()              # the client went away: its slot (or place) is free by the next step
    engine.drain(5.0)         # take no more; end run() once idle, cancelling what runs at 5 s

The engine owns one KV cache with a row per slot (vLLM's and llama.cpp's server's shape,
without paging). A request waits in a bounded queue until a slot is free; then its prompt is
prefilled into that slot's row alone, and from the next step on it decodes with every other
active sequence in one batched step, each at its own position. A sequence that ends frees its
slot at once, and a waiting request takes it at the next step: nobody waits for the slowest
sequence of a batch. All of this runs in one thread, which owns the model; the HTTP side
only submits jobs and reads what they deliver. serve.py gives the engine the main thread:
the C step's OpenMP threads run slower when started from any other (docs/serving.md).

A decode step that steps rows (the C step, the default on a CPU) steps only the slots at
work, each computed to the bit as a generation of its own would be, so a request's answer
at temperature 0, or with a seed, does not depend on who else is served. The model's
forward (a GPU's step, or --decode eager or compile) steps every slot at every step, the
same shape alone or together, so there too an answer does not change with the traffic.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from data.tokenizer import Tokenizer
from generate import StopText, check_sampling, decode_step, prefill, sample_next
from model import GPT


class QueueFull(RuntimeError):
    """Every slot is busy and the queue holds as many requests as it may."""


@dataclass(frozen=True)
class Sampling:
    """How one request samples: generate.sample_next's settings, its token budget, its
    stop strings, and whether special tokens stay out of its text (generate.TextStream).
    seed None draws from a fresh random seed."""
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class Piece:
    """Text of a sequence, in order; the pieces joined are its answer."""
    text: str


@dataclass(frozen=True)
class Done:
    """The sequence ended: "stop" (an end token or a stop string), "length" (max_tokens),
    "cancelled", or "error" (a bug, whose traceback the server printed); with the counts
    OpenAI's usage reports."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Job:
    """One request's generation: its prompt ids, its sampling, the tokens that end it, and
    where its Piece and Done events go (called from the thread that runs the engine)."""

    def __init__(self, ids: list[int], sampling: Sampling, ends: set[int],
                 deliver: Callable[[Piece | Done], None], tokenizer: Tokenizer) -> None:
        self.ids, self.sampling, self.ends, self.deliver = ids, sampling, ends, deliver
        self.text = StopText(tokenizer, sampling.stop, sampling.skip_special_tokens)
        self.generator = torch.Generator()
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(sampling.seed)
        self.generated = 0
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from this sequence's (1, vocab) logits."""
        s = self.sampling
        return int(sample_next(logits, s.temperature, s.top_k, s.top_p, self.generator))

    def take(self, token: int) -> bool:
        """Deliver what `token` adds; whether the sequence has ended."""
        self.generated += 1
        if token in self.ends:
            return self.finish("stop")
        if piece := self.text.push(token):
            self.deliver(Piece(piece))
        if self.text.stopped:
            return self.finish("stop")
        return self.generated >= self.sampling.max_tokens and self.finish("length")

    def finish(self, reason: str) -> bool:
        if reason in ("stop", "length") and (rest := self.text.flush()):
            self.deliver(Piece(rest))
        self.deliver(Done(reason, len(self.ids), self.generated))
        return True


class Engine:
    """The slots, the queue and the loop that steps them (see the module's docstring)."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, slots: int = 16, queue: int = 64,
                 decode: str = "auto") -> None:
        self.model, self.tokenizer, self.slots, self.queue_size = model, tokenizer, slots, queue
        self.cache = model.new_kv_cache(slots, model.config.block_size)
        self.step = decode_step(model, decode)
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: dict[int, Job] = {}  # slot -> job
        self.position: dict[int, int] = {}  # slot -> the position of its next token
        self.next_token: dict[int, int] = {}
        self.starting = 0  # jobs taken from the queue whose prefill has not ended
        self.tokens = self.widest_step = 0  # what load() reports
        self.wake = threading.Condition()
        self.deadline: float | None = None  # set by drain: when what still runs is cancelled

    def submit(self, job: Job) -> None:
        if len(job.ids) + job.sampling.max_tokens > self.model.config.block_size:
            raise ValueError("a prompt and its max_tokens must fit in block_size")
        with self.wake:
            if self.deadline is not None:
                raise QueueFull("the server is shutting down")
            # free slots (neither decoding nor being prefilled) take requests at once; a
            # queue of 0 means that no request ever waits for a slot
            free = self.slots - len(self.active) - self.starting
            if len(self.waiting) >= self.queue_size + max(free, 0):
                raise QueueFull(f"all {self.slots} slots are busy and {self.queue_size} "
                                f"requests wait; try again shortly")
            self.waiting.append(job)
            self.wake.notify()

    def load(self) -> dict[str, int]:
        """What /health reports: slots at work, requests waiting, and since the start the
        tokens generated and the most sequences one step has decoded."""
        return {"slots": self.slots, "active": len(self.active), "waiting": len(self.waiting),
                "tokens": self.tokens, "widest_step": self.widest_step}

    def drain(self, grace: float) -> None:
        """Take no more requests; let run() return once what runs has ended, cancelling
        whatever still runs `grace` seconds from now (from any thread, as often as asked)."""
        with self.wake:
            deadline = time.monotonic() + grace
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
            self.wake.notify()

    def run(self) -> None:
        """Admit, prefill and step until drained."""
        with torch.inference_mode():
            while (admitted := self.next_admissions()) is not None:
                try:
                    for slot, job in admitted:
                        self.start(slot, job)
                        self.starting -= 1
                    self.drop_cancelled()
                    if self.active:
                        self.decode()
                except Exception:  # a bug: its requests end with an error, the others go on
                    traceback.print_exc(file=sys.stderr)
                    for job in [*self.active.values(), *(job for _, job in admitted)]:
                        job.finish("error")
                    for table in (self.active, self.position, self.next_token):
                        table.clear()
                    self.starting = 0
        with self.wake:  # drained: what is left is cancelled
            for job in [*self.active.values(), *self.waiting]:
                job.finish("cancelled")
            self.active.clear()
            self.waiting.clear()

    def next_admissions(self) -> list[tuple[int, Job]] | None:
        """Wait for work; then the jobs that get a slot now (maybe none: the slots are
        full), or None once drained: nothing left to do, or the deadline passed."""
        with self.wake:
            while not (self.waiting or self.active or self.deadline is not None):
                self.wake.wait()
            if self.deadline is not None and (time.monotonic() >= self.deadline
                                              or not (self.waiting or self.active)):
                return None
            admitted = self.admissions()
            self.starting = len(admitted)
            return admitted

    def admissions(self) -> list[tuple[int, Job]]:
        """The waiting jobs that get a free slot now, in the order they came."""
        free = [s for s in range(self.slots) if s not in self.active]
        admitted = []
        while self.waiting and len(admitted) < len(free):
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                job.finish("cancelled")
                continue
            admitted.append((free[len(admitted)], job))
        return admitted

    def start(self, slot: int, job: Job) -> None:
        """Prefill the job's prompt into its slot's row, and take its first token."""
        ids = torch.tensor([job.ids], device=self.cache.key_pos.device)
        logits = prefill(self.model, self.step, ids, self.cache.rows(slot, slot + 1))
        token = job.sample(logits[:, -1, :])
        self.tokens += 1
        if not job.take(token):
            self.active[slot], self.position[slot], self.next_token[slot] = job, len(job.ids), token

    def drop_cancelled(self) -> None:
        """End the jobs whose clients went away, running or waiting: their slots and their
        places in the queue are free by the next step."""
        for slot, job in list(self.active.items()):
            if job.cancelled.is_set():
                job.finish("cancelled")
                self.free(slot)
        with self.wake:
            gone = [job for job in self.waiting if job.cancelled.is_set()]
            for job in gone:
                self.waiting.remove(job)
        for job in gone:
            job.finish("cancelled")

    def free(self, slot: int) -> None:
        del self.active[slot], self.position[slot], self.next_token[slot]

    def decode(self) -> None:
        """One batched step: every active sequence's newest token at its own position."""
        slots = sorted(self.active)
        self.widest_step = max(self.widest_step, len(slots))
        if self.step.steps_rows:
            rows = slots
        else:  # every row steps; an idle row writes at its position 0, which a prefill rewrites
            rows = list(range(self.slots))
        device = self.cache.key_pos.device
        idx = torch.tensor([[self.next_token.get(r, 0)] for r in rows], device=device)
        positions = torch.tensor([[self.position.get(r, 0)] for r in rows], device=device)
        chosen = torch.tensor(rows) if self.step.steps_rows else None
        logits = self.step(idx, self.cache, positions, rows=chosen)
        for i, slot in enumerate(rows):
            if slot not in self.active:
                continue
            job = self.active[slot]
            token = job.sample(logits[i:i + 1, -1, :])
            self.tokens += 1
            if job.take(token):
                self.free(slot)
            else:
                self.position[slot] += 1
                self.next_token[slot] = token
