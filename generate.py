"""Generation: from a prompt's token ids to new tokens, and on to text.

Usage:
    from generate import Chat, decode_step, generate, generate_text, stream
    out = generate(model, idx, max_new_tokens=100)             # (B, T + 100): the fast path
    out = generate(model, idx, 100, temperature=0.0, decode="eager")
    step = decode_step(model, "compile")                      # build a backend once, reuse it
    for token in stream(model, idx, 100, decode=step): ...    # (B, 1) at a time
    text = "".join(generate_text(model, tokenizer, ids, 200, stop=("\\n\\n",)))
    chat = Chat(model, tokenizer, temperature=0.0)            # a conversation, cache kept
    chat.add_user("Who am I?"); reply = "".join(chat.reply())

The file starts with the loop, `stream`, which `generate` collects: the prompt's window fills
the KV cache in one forward pass (prefill), then each step feeds one token and attends over
the cache (decode), and the window moves on when it is full. Then what the loop uses: the
KV cache, sampling (small pure functions) and the decode step of one of DECODE_BACKENDS,
"eager", "compile" or "c" (cdecode/'s C step); "auto", the default, is the C step on a CPU
when it builds and no autocast is on, and eager elsewhere. Last, what is built on the loop:
text, cut at end-of-text or a stop string (data/text.py decodes and cuts it), and Chat, which
keeps its cache across turns.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F

from data.chat import ASSISTANT_END, render_prompt, special_ids, with_system
from data.text import StopText, TextStream, check_text
from data.tokenizer import Tokenizer
from machine.device import check_compile
from machine.errors import InputError
from machine.threads import fit_threads
from model import GPT, GPTConfig

# --- the loop: prefill, decode and the context window -----------------------------------

@torch.inference_mode()
def stream(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, use_kv_cache: bool = True,
           generator: torch.Generator | None = None,
           decode: str | DecodeStep = "auto") -> Iterator[torch.Tensor]:
    """Yield (B, 1) new tokens one step at a time, continuing the (B, T) prompt `idx`.

    Context window: the model sees at most block_size tokens. When the next token would
    not fit, the window jumps forward to keep the most recent block_size // 2 tokens (at
    least one), and the cache is rebuilt from them by one prefill. It jumps, where nanoGPT
    slides by one (idx[:, -block_size:]), because a cached key holds its position, and a
    slide would move every key and rebuild the cache at every step, not every block_size // 2
    tokens. The cached and uncached paths use the same window, so their logits agree at every step.
    decode: a backend name (see decode_step) or a step it built; ignored without the cache.
    """
    check_sampling(temperature, top_k, top_p)
    B, n = idx.size()
    if n == 0:
        raise InputError("generation needs a prompt of at least one token")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    block_size = model.config.block_size
    # the tokens the model sees, plus room for the one sampled last; memory does not grow
    # with max_new_tokens, so a generation can go on for as long as it is read
    window = torch.empty(B, block_size + 1, dtype=idx.dtype, device=idx.device)
    T = min(n, block_size)  # how many tokens the window holds
    window[:, :T] = idx[:, n - T:]
    cache, step = None, None
    if use_kv_cache:
        cache = new_kv_cache(model, B, cache_length(n, max_new_tokens, block_size))
        step = decode_step(model, decode) if isinstance(decode, str) else decode
    cached, next_token = 0, None  # how many of the window's tokens the cache holds; the last token
    # a CPU's thread count is timed per token, without the caller's work between tokens, and the
    # fastest kept (machine/threads.py), because a step this small is often faster on fewer threads
    with fit_threads(0, idx.device, say=lambda _: None) as threads:
        for _ in range(max_new_tokens):
            started = time.perf_counter()
            if T > block_size:  # the window is full, so it jumps: it keeps its most recent tokens
                keep = max(1, block_size // 2)  # at least one, for a bigram model's block_size of 1
                window[:, :keep] = window[:, T - keep:T]  # no overlap, because T - keep >= keep
                T, cached = keep, 0
            if cache is None:  # as nanoGPT does: the whole window, every step
                logits, _ = model(window[:, :T], logits_from=-1)
            elif cached == 0:  # prefill: the whole window in one pass, at positions 0..T-1
                logits = prefill(model, step, window[:, :T], cache)
            else:  # decode the token sampled last, at T - 1 (the mask hides any older keys past it)
                logits = step(next_token, cache, torch.tensor([T - 1], device=idx.device))
            cached = T
            next_token = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
            window[:, T] = next_token[:, 0]
            T += 1
            threads.step(time.perf_counter() - started)
            yield next_token


def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, use_kv_cache: bool = True,
             generator: torch.Generator | None = None,
             decode: str | DecodeStep = "auto") -> torch.Tensor:
    """Prompt plus max_new_tokens sampled tokens, (B, T + max_new_tokens). See `stream`."""
    new = list(stream(model, idx, max_new_tokens, temperature, top_k, top_p, use_kv_cache,
                      generator, decode))
    return torch.cat([idx, *new], dim=1)


def prefill(model: GPT, step: DecodeStep, idx: torch.Tensor, cache: KVCache,
            start: int = 0) -> torch.Tensor:
    """Run the tokens idx (B, T) at positions start..start+T-1 in one pass, filling the
    cache, and return the last token's logits (B, 1, vocab_size). Up to step.max_prefill
    tokens go through the step (the C step reads each weight once for all of them); longer
    windows go through the model's forward, whose matrix products are faster there."""
    positions = torch.arange(start, start + idx.size(1), device=idx.device)
    if idx.size(1) <= step.max_prefill:
        return step(idx, cache, positions)
    return model(idx, kv_cache=cache, input_pos=positions, logits_from=-1)[0]


def cache_length(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Slots of a generation's KV cache, over all of which every step attends (see KVCache): the
    prompt plus every new token except the last, which is never fed back, rounded up to a power
    of two, so that a compiled step is built for few sizes."""
    filled = prompt_len + max_new_tokens - 1
    slots = 1
    while slots < filled:  # the smallest power of two that holds them
        slots *= 2
    return min(block_size, slots)


# --- the KV cache ------------------------------------------------------------------------

def new_kv_cache(model: GPT, batch_size: int, max_len: int | None = None) -> KVCache:
    """An empty cache for the model, on its device, in the dtype its keys come out in."""
    p = model.transformer.wte.weight  # int8 weights (weights/quantize.py) give float32 keys
    dtype = torch.float32 if p.dtype == torch.int8 else p.dtype
    dtype = torch.get_autocast_dtype(p.device.type) if torch.is_autocast_enabled(p.device.type) else dtype
    return KVCache(model.config, batch_size, max_len or model.config.block_size, dtype, p.device)


class KVCache:
    """Every layer's keys and values, and each position's token id (for the bigram table), written
    at the positions the caller gives and read whole under a mask, so a decode step has one shape."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)  # GQA: fewer heads
        # one tensor per layer, because compiled code that writes into a view copies the whole buffer
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.key_pos = torch.arange(max_len, device=device)  # (max_len,)
        self.ids = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store (B, n_kv_head, T, head_dim) keys and values at input_pos, (T,) for every row or
        (B, T) with each row's own (a server's batch). Return all the keys and values and the
        mask of the keys each query may see, (T, max_len) or (B, 1, T, max_len)."""
        if input_pos.dim() == 1:
            self.k[layer][:, :, input_pos] = k
            self.v[layer][:, :, input_pos] = v
        else:  # indexing rows and positions together puts their dims first: (B, T, heads, hd)
            rows = torch.arange(k.size(0), device=k.device)[:, None]
            self.k[layer][rows, :, input_pos] = k.transpose(1, 2)
            self.v[layer][rows, :, input_pos] = v.transpose(1, 2)
        mask = input_pos[..., None] >= self.key_pos  # a query at p sees keys 0..p, nothing later
        return self.k[layer], self.v[layer], mask if input_pos.dim() == 1 else mask[:, None]

    def update_ids(self, idx: torch.Tensor, input_pos: torch.Tensor, no_prev: int) -> torch.Tensor:
        """Store the (B, T) token ids at input_pos, as update() stores keys, and return the id of
        the token before each (for the first, an earlier call's), or no_prev at position 0."""
        rows = torch.arange(idx.size(0), device=idx.device)[:, None]
        self.ids[rows, input_pos] = idx
        return self.ids[rows, (input_pos - 1).clamp(min=0)].masked_fill(input_pos == 0, no_prev)

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start..stop-1, sharing this cache's memory: a server prefills one row alone."""
        view = copy.copy(self)
        view.k, view.v = [k[start:stop] for k in self.k], [v[start:stop] for v in self.v]
        view.ids = self.ids[start:stop]
        return view


# --- sampling ----------------------------------------------------------------------------

def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise InputError for sampling settings that mean nothing."""
    if not 0 <= temperature < float("inf"):  # also refuses nan
        raise InputError(f"temperature must be >= 0 (0 means greedy) and finite, got {temperature}")
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest logits of each row (ties as torch.topk breaks them), -inf elsewhere."""
    k = min(k, logits.size(-1))
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p,
    and always the most likely one (as vLLM and llama.cpp do)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = F.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= p  # the probability of the tokens ranked above each
    # nothing ranks above the top token; keep it even where p rounds to 0 in float32 (0 >= 0)
    drop[..., 0] = False
    sorted_logits[drop] = float("-inf")
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of (B, vocab) logits, returned as (B, 1), as nanoGPT does (divide
    by the temperature, keep the top k, sample from the softmax), with top_p, and greedily at
    temperature 0. Three steps keep extreme temperatures sound. The largest logit is moved to 0,
    so that a tiny temperature sends the others to -inf (greedy), never to +inf (nan). top_k
    comes before the division, because a huge temperature can round distinct logits to one
    value. The temperature is clamped to float32's normal range, because beyond it the division
    acts as a division by 0 or by inf would."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    logits = logits - logits.amax(dim=-1, keepdim=True)
    if top_k is not None:
        logits = filter_top_k(logits, top_k)
    finfo = torch.finfo(torch.float32)
    logits = logits / min(max(temperature, finfo.tiny), finfo.max)
    if top_p is not None and top_p < 1.0:
        logits = filter_top_p(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


# --- the decode steps that the loop calls: their protocol and backends ---------------

# The decode backends that decode_step builds, each with a short description. They are the
# --decode choices of sample.py and serve.py, and the descriptions are their help (cli/options.py).
DECODE_BACKENDS = {
    "auto": "the C step on a CPU when it builds, else eager",
    "eager": "the model's forward",
    "compile": "torch.compile: seconds to tens of seconds to build on a CPU; a CUDA graph on a GPU",
    "c": "cdecode/decode_step.c, built by the system C compiler",
}


def check_decode(decode: str, name: str = "decode") -> None:
    """Raise InputError unless `decode` names one of DECODE_BACKENDS; `name` is the setting
    as its user knows it (a command's "--decode")."""
    if decode not in DECODE_BACKENDS:
        raise InputError(f"{name} must be one of {', '.join(DECODE_BACKENDS)}, got {decode!r}")


class DecodeStep(Protocol):
    """One cached decode step, and what it can do besides. A call takes (B, 1) token ids at the
    window position input_pos, of shape (1,), or (B, 1) with one per row (a server's batch), writes
    their keys and values into the cache, and returns (B, 1, vocab_size) logits.

    name: what it is called in messages and measurements: "eager", "compiled" or "C step".
    max_prefill: the most tokens, at consecutive positions input_pos (T,), that one call may
        take, returning the logits of the last one (1 for a plain step); `prefill` passes
        longer windows to the model's forward instead.
    steps_chosen_rows: whether a call may step only the B rows of the cache that `rows`
        names, leaving the others untouched. Without it, B is the cache's batch and every
        call steps every row, so every step has one shape (as a compiled step needs).
    """

    name: str
    max_prefill: int
    steps_chosen_rows: bool

    def __call__(self, idx: torch.Tensor, kv_cache: KVCache, input_pos: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelStep:
    """A DecodeStep that runs `forward` (the model's, eager or compiled) on every row of the
    cache, one token at a time."""
    name: str
    forward: Callable[[torch.Tensor, KVCache, torch.Tensor], torch.Tensor]
    max_prefill: int = 1
    steps_chosen_rows: bool = False

    def __call__(self, idx: torch.Tensor, kv_cache: KVCache, input_pos: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            raise ValueError(f"the {self.name} decode step steps every row of the cache; "
                             f"it takes no rows")
        return self.forward(idx, kv_cache, input_pos)


def eager_step(model: GPT) -> ModelStep:
    def step(idx: torch.Tensor, kv_cache: KVCache, input_pos: torch.Tensor) -> torch.Tensor:
        return model(idx, kv_cache=kv_cache, input_pos=input_pos)[0]
    return ModelStep("eager", step)


def compiled_step(model: GPT, cuda_graphs: bool = True) -> ModelStep:
    """The decode step through torch.compile. Every step has the same shapes (see KVCache),
    so it builds one graph per cache size and batch size on the first step, which is slow on
    a CPU (docs/decoding.md). On a CUDA GPU, unless cuda_graphs is False, the step is also
    replayed as a CUDA graph (gpt-fast's "reduce-overhead"): one launch for the whole step
    rather than one per kernel, because launches are what bound a small model's decoding."""
    def step(idx: torch.Tensor, kv_cache: KVCache, input_pos: torch.Tensor) -> torch.Tensor:
        # It uses the explicit attention path, because for a single query inductor fuses QK^T and AV
        # with the softmax into its own loops, whereas SDPA stays a library call (and a slow
        # one in bf16 on CPUs without bf16 arithmetic).
        return model(idx, kv_cache=kv_cache, input_pos=input_pos, attention="explicit")[0]

    device = model.lm_head.weight.device
    if device.type == "cuda" and cuda_graphs:
        graphed = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
        marked: weakref.WeakSet[KVCache] = weakref.WeakSet()  # caches seen, marked once each

        def replay(idx: torch.Tensor, kv_cache: KVCache, input_pos: torch.Tensor) -> torch.Tensor:
            # A graph may write into the cache in place only if the cache stays at one
            # address; otherwise it would copy the whole cache in and out at every step.
            # With guard=False, a new cache (a new generation) re-records the graph instead
            # of recompiling it.
            if kv_cache not in marked:
                for buffer in (*kv_cache.k, *kv_cache.v, kv_cache.key_pos, kv_cache.ids):
                    torch._dynamo.mark_static_address(buffer, guard=False)
                marked.add(kv_cache)
            # the logits live in the graph's memory, which its next replay overwrites
            return graphed(idx, kv_cache, input_pos).clone()
        return ModelStep("compiled", replay)
    if device.type != "cpu":
        return ModelStep("compiled", torch.compile(step, fullgraph=True, dynamic=False))
    options = {
        # drive the graph from generated C++, not Python, so there are no per-kernel Python calls
        "cpp_wrapper": True,
        # with one row of activations every matmul is a matrix-vector product bound by
        # reading the weights; as generated loops it fuses with its bias, GELU and
        # residual add instead of being one library call each
        "post_grad_fusion_options": {"decompose_mm_pass": {}},
    }
    return ModelStep("compiled", torch.compile(step, fullgraph=True, dynamic=False, options=options))


@functools.cache
def say_once(message: str) -> None:
    """One line on stderr, once per process however many generations meet the same case."""
    print(message, file=sys.stderr)


def decode_step(model: GPT, decode: str = "auto") -> DecodeStep:
    """The decode step of backend `decode` (see DECODE_BACKENDS) for `model`, built now. Build
    it after moving the model to its device and dtype; the C step reads the weights in place,
    so it sees later updates of their values but not a move or a cast."""
    check_decode(decode)
    if decode == "eager":
        return eager_step(model)
    if decode == "compile":
        check_compile(model.lm_head.weight.device, instead="choose another --decode")
        return compiled_step(model)
    from cdecode import BuildError, CDecodeStep  # imported only here, where a C step is wanted
    if decode == "c":
        return CDecodeStep(model)
    weight = model.lm_head.weight
    # The C step computes in the weights' dtype; under autocast, only the eager step
    # computes in autocast's dtype.
    if weight.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return eager_step(model)
    try:
        return CDecodeStep(model)
    except BuildError as e:
        say_once(f"note: decoding with the slower eager step: {e}")
        return eager_step(model)


# --- text --------------------------------------------------------------------------------

def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of the prompt; an empty prompt starts from the tokenizer's natural start
    (GPT-2's end-of-text token, or a newline for a character vocabulary). Raises InputError for
    text the tokenizer cannot encode, or that is not text (data.text.check_text)."""
    if prompt:
        check_text(prompt, "prompt")
        try:
            return tokenizer.encode(prompt)
        except ValueError as e:
            raise InputError(f"prompt: {e}") from None
    if tokenizer.eot_token is not None:
        return [tokenizer.eot_token]
    try:
        return tokenizer.encode("\n")
    except ValueError:  # a character vocabulary without newlines
        return [0]


def generate_text(model: GPT, tokenizer: Tokenizer, ids: list[int], max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  use_kv_cache: bool = True, generator: torch.Generator | None = None,
                  stop: tuple[str, ...] = (), decode: str | DecodeStep = "auto",
                  skip_special_tokens: bool = True) -> Iterator[str]:
    """Yield the continuation of `ids` as text, piece by piece, ending before the
    end-of-text token or the first stop string (see StopText)."""
    text = StopText(tokenizer, stop, skip_special_tokens)
    device = model.lm_head.weight.device
    tokens = stream(model, torch.tensor([ids], device=device), max_new_tokens, temperature,
                    top_k, top_p, use_kv_cache, generator, decode)
    for token in tokens:
        token_id = token.item()
        if token_id == tokenizer.eot_token:
            break
        if piece := text.push(token_id):
            yield piece
        if text.stopped:
            return
    yield text.flush()


# --- chat --------------------------------------------------------------------------------

class Chat:
    """A conversation with a chat model (data/chat.py's format) that keeps its KV cache
    across turns, so that a turn prefills only the tokens the cache does not hold yet. The
    history is kept as token ids, each reply exactly as it was sampled, so the cache holds
    what a fresh prefill of the whole conversation would. When a turn would not fit in
    block_size, the oldest turns are dropped (add_user says how many) and the cache is
    refilled from the rest, with the system text folded into the new first turn."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, *, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None, decode: str | DecodeStep = "auto",
                 system: str | None = None, skip_special_tokens: bool = True) -> None:
        check_sampling(temperature, top_k, top_p)
        self.model, self.tokenizer, self.ids_of = model, tokenizer, special_ids(tokenizer)
        self.skip_special_tokens = skip_special_tokens  # for replies; see TextStream
        self.sampling = (temperature, top_k, top_p, generator)
        self.max_new_tokens = max_new_tokens
        self.step = decode_step(model, decode) if isinstance(decode, str) else decode
        self.cache = new_kv_cache(model, 1, model.config.block_size)
        self.reset(system)

    def reset(self, system: str | None = None) -> None:
        """Start over, with `system` as the system message."""
        self.system = system
        self.turns: list[tuple[str, list[int]]] = []  # (user text, reply ids) of each turn
        self.ids: list[int] = []  # the conversation so far, ending with the open reply
        self.cached = 0  # how many of ids the cache holds, from the first
        self.pending: str | None = None  # the user turn that reply() answers

    def rendered(self, turns: list[tuple[str, list[int]]], text: str) -> list[int]:
        """The conversation of `turns` and a new user turn, opening the reply."""
        messages = [m for user, reply in turns for m in (("user", user), ("assistant", reply))]
        return render_prompt(self.tokenizer, with_system(self.system, [*messages, ("user", text)]))

    def add_user(self, text: str) -> int:
        """Add a user turn and return how many of the oldest turns were dropped to make room
        for it and at least one token of reply. Raises InputError if it cannot fit even alone."""
        block_size, kept = self.model.config.block_size, self.turns
        ids = self.rendered(kept, text)
        while len(ids) >= block_size and kept:
            kept = kept[1:]
            ids = self.rendered(kept, text)
        if len(ids) >= block_size:  # the conversation is left as it was
            raise InputError(f"this message takes {len(ids)} tokens with the chat tokens, "
                             f"and the model's context holds {block_size}; write a shorter one")
        same = next((i for i, (a, b) in enumerate(zip(self.ids, ids, strict=False)) if a != b),
                    min(len(self.ids), len(ids)))
        self.cached = min(self.cached, same)  # what follows `same` in the cache is stale
        dropped, self.turns = len(self.turns) - len(kept), kept
        self.ids, self.pending = ids, text
        return dropped

    @torch.inference_mode()
    def reply(self) -> Iterator[str]:
        """The reply to the last user turn, as text, piece by piece. It ends at
        <|assistant_end|>, at max_new_tokens, or where the context is full; the turn is
        closed with <|assistant_end|> either way."""
        if self.pending is None:
            raise InputError("reply() answers a user turn; add one with add_user first")
        end, device = self.ids_of[ASSISTANT_END], self.model.lm_head.weight.device
        budget = min(self.max_new_tokens, self.model.config.block_size - len(self.ids))
        text, start = TextStream(self.tokenizer, self.skip_special_tokens), len(self.ids)
        for _ in range(budget):
            new = torch.tensor([self.ids[self.cached:]], device=device)
            logits = prefill(self.model, self.step, new, self.cache, self.cached)
            self.cached = len(self.ids)
            token = sample_next(logits[:, -1, :], *self.sampling).item()
            self.ids.append(token)
            if token == end:
                break
            if piece := text.push([token]):
                yield piece
        else:
            self.ids.append(end)
        yield text.flush()
        self.turns.append((self.pending, self.ids[start:-1]))
        self.pending = None
