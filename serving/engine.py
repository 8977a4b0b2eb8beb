"""Continuous batching: many requests decode together in one batched step, a cached prefix is
reused across requests, and long prompts are prefilled in chunks between steps.

Usage:
    engine = Engine(model, tokenizer, slots=16, queue=64)
    threading.Thread(target=engine.run).start()   # serve.py runs it in the main thread
    job = Job(ids, Sampling(max_tokens=64, temperature=0.0), ends={eot}, deliver=callback,
              tokenizer=tokenizer)
    engine.submit(job)        # QueueFull if the queue is full; deliver() gets Pieces, then Done
    job.cancel()              # the client went away; its slot (or place) is free by the next step
    engine.submit(Scoring([[464, 3290, 318]], top=1, deliver=callback))   # an echo's logprobs
    engine.drain(5.0)         # take no more work; run() returns once idle, cancelling at 5 s

The engine owns one KV cache with a row per slot (the layout of vLLM's and llama.cpp's
servers, without paging). After its sequence ends, a slot keeps the tokens its row holds,
and a new request takes the free slot whose tokens share the longest prefix with its
prompt, so that only the rest has to be prefilled. This pays off because an OpenAI client
sends a conversation's whole history with every turn, and all but the new turn is already
in the cache (llama.cpp's cache_prompt, vLLM's prefix caching). A request waits in a bounded
queue until a slot is free. Its prompt is then prefilled in chunks, one chunk per step of
the other sequences, so that a long prompt holds back nobody's next token. From then on it
decodes with every other active sequence in one batched step, each at its own position. A
sequence that ends frees its slot at once. All of this runs in one thread, which owns the
model; the HTTP side only submits work and reads what the engine delivers. serve.py gives
the engine the main thread, because the C step's OpenMP threads run slower when they are
started from any other thread (docs/serving.md).

A decode step that steps chosen rows (the C step, the default on a CPU) steps only the slots
at work, and it computes every token the same way, whether in a prefill chunk or a decode
step, alone or beside others. A request's answer at temperature 0, or with a seed, is
therefore the same to the bit on a cold server and with a reused prefix, whoever else is
being served. The model's forward (a GPU's step, or --decode eager or compile) steps every
slot at every step, so its shapes are the same alone or together, but a prefix it reuses
holds keys and values that match a cold prefill's only up to float rounding
(docs/serving.md).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from cdecode import CDecodeStep
from data.text import StopText
from data.tokenizer import Tokenizer
from generate import check_sampling, decode_step, new_kv_cache, sample_next
from machine.errors import InputError
from machine.perf import check_room
from machine.threads import fit_threads
from measure.logprobs import Scored, token_logprobs
from measure.memory import decode_needs
from model import GPT

MODEL_CHUNK = 256  # prompt tokens per prefill call when the model's forward prefills


class QueueFull(RuntimeError):
    """Every slot is busy and the queue holds as many requests as it may."""


@dataclass(frozen=True)
class Sampling:
    """How one request samples: generate.sample_next's settings, the token budget, the stop
    strings, whether special tokens are left out of the text (data.text.TextStream), and the
    logprobs to report for each generated token (None for none, or N for the token's own logprob
    and those of N alternatives). A seed of None draws from a fresh random seed."""
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token, its log-probability under the model (before the sampling settings
    reshape the distribution), and the likeliest alternatives at its position, as
    (id, logprob) pairs."""
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Piece:
    """The next text of a sequence; its pieces joined in order make its answer. With
    logprobs, a piece also carries the tokens taken since the last piece, whose text it
    completes."""
    text: str
    tokens: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    """The end of a sequence, with its reason and the counts that OpenAI's usage reports.
    The reason is "stop" (an end token or a stop string), "length" (max_tokens reached),
    "cancelled", or "error" (a bug, whose traceback the server printed)."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Job:
    """One sequence's generation: its prompt ids, its sampling, the tokens that end it, the
    callback that receives its Piece and Done events (called from the engine's thread), and
    whether it may start from a slot's cached prefix (llama.cpp's cache_prompt)."""

    def __init__(self, ids: list[int], sampling: Sampling, ends: set[int],
                 deliver: Callable[[Piece | Done], None], tokenizer: Tokenizer,
                 reuse: bool = True) -> None:
        self.ids, self.sampling, self.ends, self.deliver = ids, sampling, ends, deliver
        self.reuse = reuse  # whether a cached prefix may stand for part of the prompt
        self.text = StopText(tokenizer, sampling.stop, sampling.skip_special_tokens)
        self.generator = torch.Generator()
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(sampling.seed)
        self.generated = 0
        self.taken: list[TokenLogprob] = []  # the next piece's tokens, when logprobs are asked
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def sample(self, logits: torch.Tensor) -> int:
        """Draw the next token from this sequence's (1, vocab) logits, and note its logprobs
        when the request asks for them."""
        s = self.sampling
        token = int(sample_next(logits, s.temperature, s.top_k, s.top_p, self.generator))
        if s.logprobs is not None:
            logp = F.log_softmax(logits[0].float(), dim=-1)
            top = logp.topk(s.logprobs) if s.logprobs else None
            self.taken.append(TokenLogprob(token, float(logp[token]), () if top is None else
                                           tuple(zip(top.indices.tolist(), top.values.tolist(),
                                                     strict=True))))
        return token

    def take(self, token: int) -> bool:
        """Deliver the text that `token` adds, and return whether the sequence has ended."""
        self.generated += 1
        if token in self.ends:
            return self.finish("stop")
        if piece := self.text.push(token):
            self.deliver(self.piece(piece))
        if self.text.stopped:
            return self.finish("stop")
        return self.generated >= self.sampling.max_tokens and self.finish("length")

    def piece(self, text: str) -> Piece:
        tokens, self.taken = tuple(self.taken), []
        return Piece(text, tokens)

    def finish(self, reason: str) -> bool:
        if reason in ("stop", "length"):  # deliver the held-back text and last logprobs
            rest = self.text.flush()
            if rest or self.taken:
                self.deliver(self.piece(rest))
        self.deliver(Done(reason, len(self.ids), self.generated))
        return True


@dataclass
class Scoring:
    """The logprobs of whole sequences, scored together (logprobs.token_logprobs), which is
    what a completion that echoes its prompt reports about it. deliver gets the list of
    Scored, or an Exception. `answers`, where given, holds one Job per sequence, each for a
    single token drawn from the logits that the same pass gives after the sequence, so no
    prefill is needed. This serves lm-eval, which asks for an echo and one token and reads
    only the echo."""
    sequences: list[list[int]]
    top: int
    deliver: Callable[[list[Scored] | Exception], None]
    answers: list[Job] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """The slots, the queue and the loop that steps them (see the module's docstring)."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, slots: int = 16, queue: int = 64,
                 decode: str = "auto") -> None:
        self.model, self.tokenizer, self.slots, self.queue_size = model, tokenizer, slots, queue
        self.block_size = model.config.block_size
        self.step = decode_step(model, decode)
        # A step that can prefill (the C step) takes every chunk itself, so that a token's
        # keys and values are the same whichever way they were computed.
        self.chunk = self.step.max_prefill if self.step.max_prefill > 1 else MODEL_CHUNK
        # Checked before the cache is allocated, because slots past memory (--parallel
        # 1000000) would end in the allocator's traceback or swap the machine. The C step
        # takes at most every slot's token, or one prefill chunk, in one call.
        c_step_tokens = max(slots, self.chunk) if isinstance(self.step, CDecodeStep) else 0
        check_room(f"--parallel {slots}", decode_needs(model, slots, self.block_size, c_step_tokens),
                   model.lm_head.weight.device, "lower --parallel", InputError)
        self.cache = new_kv_cache(model, slots, self.block_size)
        self.waiting: collections.deque[Job | Scoring] = collections.deque()
        self.held: list[list[int]] = [[] for _ in range(slots)]  # each row's tokens in the cache
        self.used: list[int] = [0] * slots  # when each slot last took a job; the oldest goes first
        self.active: dict[int, Job] = {}  # slot -> job, decoding or still prefilling
        self.pending: dict[int, list[int]] = {}  # slot -> prompt ids still to prefill
        self.next_token: dict[int, int] = {}  # slot -> the token it feeds at the next step
        self.starting = 0  # jobs taken from the queue but not yet fully admitted
        self.counts = collections.Counter()  # what load() and metrics() report
        self.wake = threading.Condition()
        self.deadline: float | None = None  # set by drain(); when running work gets cancelled

    def submit(self, work: Job | Scoring) -> None:
        if isinstance(work, Job) and len(work.ids) + work.sampling.max_tokens > self.block_size:
            raise ValueError("a prompt and its max_tokens must fit in block_size")
        with self.wake:
            if self.deadline is not None:
                raise QueueFull("the server is shutting down")
            # Free slots (neither decoding nor being admitted) take requests at once, so the
            # queue limit counts only the requests beyond them; a queue of 0 means that no
            # request ever waits for a slot.
            free = self.slots - len(self.active) - self.starting
            if len(self.waiting) >= self.queue_size + max(free, 0):
                raise QueueFull(f"all {self.slots} slots are busy and {self.queue_size} "
                                f"requests wait; try again shortly")
            self.waiting.append(work)
            self.wake.notify()

    def load(self) -> dict[str, int]:
        """What /health reports: the slots at work and the requests waiting, and, since the
        start, the tokens generated, the prompt tokens prefilled or reused from a slot's
        cache, and the most sequences that one step has decoded."""
        return {"slots": self.slots, "active": len(self.active), "waiting": len(self.waiting),
                "tokens": self.counts["tokens"], "prompt_tokens": self.counts["prompt"],
                "prompt_tokens_reused": self.counts["reused"],
                "prompt_tokens_prefilled": self.counts["prefilled"],
                "widest_step": self.counts["widest"]}

    def drain(self, grace: float) -> None:
        """Take no more requests, and let run() return once the running work has ended,
        cancelling whatever still runs `grace` seconds from now. Any thread may call this,
        as often as it likes."""
        with self.wake:
            deadline = time.monotonic() + grace
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
            self.wake.notify()

    def run(self) -> None:
        """Admit, prefill and step until drained."""
        # this thread's CPU thread count is timed per batched step and the fastest kept
        # (machine/threads.py), because a small step runs faster on fewer threads beside a neighbour
        device = self.cache.key_pos.device
        with torch.inference_mode(), fit_threads(0, device, say=lambda _: None) as threads:
            while (admitted := self.next_admissions()) is not None:
                try:
                    for slot, work in admitted:
                        self.admit(slot, work)
                        self.starting -= 1
                    self.drop_cancelled()
                    if self.next_token:
                        started = time.perf_counter()
                        self.decode()
                        threads.step(time.perf_counter() - started)
                    for slot in list(self.pending):
                        self.prefill_chunk(slot)
                except Exception:  # a bug ends the running requests; the waiting ones go on
                    traceback.print_exc(file=sys.stderr)
                    for job in {*self.active.values(), *(job for _, job in admitted
                                                         if isinstance(job, Job))}:
                        job.finish("error")
                    for slot in list(self.active):
                        self.free(slot)
                    self.starting = 0
        with self.wake:  # drained, so whatever is left is cancelled
            for job in [*self.active.values(), *self.waiting]:
                if isinstance(job, Job):
                    job.finish("cancelled")
                else:
                    job.deliver(RuntimeError("the server is stopping"))
            for slot in list(self.active):
                self.free(slot)
            self.waiting.clear()

    def next_admissions(self) -> list[tuple[int, Job | Scoring]] | None:
        """Wait for work, then return the work that starts now (possibly none, when the
        slots are full), or None once drained, that is, when nothing is left to do or the
        deadline has passed."""
        with self.wake:
            while not (self.waiting or self.active or self.deadline is not None):
                self.wake.wait()
            if self.deadline is not None and (time.monotonic() >= self.deadline
                                              or not (self.waiting or self.active)):
                return None
            admitted = self.admissions()
            self.starting = len(admitted)
            return admitted

    def admissions(self) -> list[tuple[int, Job | Scoring]]:
        """The waiting work that starts now, in arrival order. A Scoring starts at once; a
        Job takes the free slot whose cached tokens share the longest prefix with its prompt
        (among equals, the slot unused the longest). Cancelled work ends here."""
        free = {s for s in range(self.slots) if s not in self.active}
        admitted: list[tuple[int, Job | Scoring]] = []
        while self.waiting and (free or isinstance(self.waiting[0], Scoring)):
            work = self.waiting.popleft()
            if work.cancelled.is_set():
                if isinstance(work, Job):
                    work.finish("cancelled")
                continue
            if isinstance(work, Scoring):
                admitted.append((-1, work))
                continue
            slot = max(free, key=lambda s: (shared_prefix(self.held[s], work.ids), -self.used[s]))
            free.remove(slot)
            admitted.append((slot, work))
        return admitted

    def admit(self, slot: int, work: Job | Scoring) -> None:
        """Start the work. A Scoring's sequences are scored now. A Job takes its slot, keeps
        the cached prefix of its prompt and leaves the rest to prefill. At most all but the
        last prompt token is kept, because the first new token is drawn from that last
        token's logits."""
        if isinstance(work, Scoring):
            try:
                scored = token_logprobs(self.model, work.sequences, work.top,
                                        following=bool(work.answers))
            except Exception as e:  # a bug, reported in the log and to the request
                traceback.print_exc(file=sys.stderr)
                work.deliver(e)
                for job in work.answers:
                    job.finish("error")
                return
            work.deliver(scored)
            for job, s in zip(work.answers, scored, strict=False):  # none, or one per sequence
                self.counts["tokens"] += 1
                job.take(job.sample(s.following))
            return
        kept = min(shared_prefix(self.held[slot], work.ids), len(work.ids) - 1) if work.reuse else 0
        del self.held[slot][kept:]
        self.counts["prompt"] += len(work.ids)
        self.counts["reused"] += kept
        self.counts["used"] += 1
        self.active[slot], self.used[slot] = work, self.counts["used"]
        self.pending[slot] = work.ids[kept:]

    def prefill_chunk(self, slot: int) -> None:
        """Prefill the next chunk of the slot's prompt into its row; after the last chunk,
        draw the first token from its logits."""
        job, rest = self.active[slot], self.pending[slot]
        chunk, self.pending[slot] = rest[:self.chunk], rest[self.chunk:]
        start = len(self.held[slot])
        ids = torch.tensor([chunk], device=self.cache.key_pos.device)
        positions = torch.arange(start, start + len(chunk), device=ids.device)
        row = self.cache.rows(slot, slot + 1)
        if len(chunk) <= self.step.max_prefill:
            logits = self.step(ids, row, positions)
        else:
            logits = self.model(ids, kv_cache=row, input_pos=positions, logits_from=-1)[0]
        self.held[slot] += chunk
        self.counts["prefilled"] += len(chunk)
        if self.pending[slot]:
            return
        del self.pending[slot]
        token = job.sample(logits[:, -1, :])
        self.counts["tokens"] += 1
        if job.take(token):
            self.free(slot)
        else:
            self.next_token[slot] = token

    def drop_cancelled(self) -> None:
        for slot, job in list(self.active.items()):
            if job.cancelled.is_set():
                job.finish("cancelled")
                self.free(slot)

    def free(self, slot: int) -> None:
        """Let the slot take new work; its row keeps its tokens for a prompt that shares them."""
        self.active.pop(slot, None)
        self.pending.pop(slot, None)
        self.next_token.pop(slot, None)

    def decode(self) -> None:
        """One batched step: every decoding sequence's newest token, each at its own position."""
        slots = sorted(self.next_token)
        self.counts["widest"] = max(self.counts["widest"], len(slots))
        rows = slots if self.step.steps_chosen_rows else list(range(self.slots))
        # A row that is only along for the ride (the model's forward steps every row)
        # writes its keys and values past the tokens it holds, where nothing reads them. A
        # full row writes at its last position instead and forgets the token held there.
        positions = {r: len(self.held[r]) for r in rows}
        for r in rows:
            if r not in self.next_token and positions[r] >= self.block_size:
                positions[r] = self.block_size - 1
                del self.held[r][positions[r]:]
        device = self.cache.key_pos.device
        idx = torch.tensor([[self.next_token.get(r, 0)] for r in rows], device=device)
        pos = torch.tensor([[positions[r]] for r in rows], device=device)
        chosen = torch.tensor(rows) if self.step.steps_chosen_rows else None
        logits = self.step(idx, self.cache, pos, rows=chosen)
        for i, slot in enumerate(rows):
            if slot not in self.next_token:
                continue
            job = self.active[slot]
            self.held[slot].append(self.next_token[slot])
            token = job.sample(logits[i:i + 1, -1, :])
            self.counts["tokens"] += 1
            if job.take(token):
                self.free(slot)
            else:
                self.next_token[slot] = token


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share from their start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
