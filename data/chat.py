"""Conversations: checked, then rendered to token ids with nanochat's special tokens, with the
loss mask that makes a model learn the assistant's turns and nothing else. Training, the chat
REPL and the server all render here, so the three cannot drift apart.

Usage:
    from data.chat import check_conversation, render_conversation, render_prompt
    turns = check_conversation(messages)               # [(role, text)], or ConversationError
    ids, mask = render_conversation(tokenizer, turns)   # SFT: learn ids[i] where mask[i]
    ids = render_prompt(tokenizer, turns)               # ends with <|assistant_start|>
    meta = with_specials(tokenizer.to_meta(), CHAT_SPECIALS)   # a tokenizer's description, to chat

The format is nanochat's:

    <|bos|><|user_start|>Who am I?<|user_end|><|assistant_start|>Anna.<|assistant_end|>
    <|user_start|>...

`messages` is OpenAI's: [{"role": "system" | "user" | "assistant", "content": "..."}], where
"developer" (OpenAI's newer name) is "system", and content may be a list of text parts
([{"type": "text", "text": "..."}], joined by newlines, as vLLM joins them). A
system message is not a turn of its own: its text opens the first user turn, then a blank
line, then the user's text. That is nanochat's choice, and it suits this project too,
because a model that learns two roles serves three, and the few tokens of instructions sit
where the model reads the user.

Text is encoded as ordinary text: a message that spells "<|user_start|>" gets the ids of its
characters, never the special id. Only this module writes special ids, so the mask, which
they delimit, can be read back from the ids alone (`assistant_mask`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.sources import DataError
from data.specials import CHAT_SPECIALS
from data.text import check_text
from data.tokenizer import Tokenizer, load_tokenizer
from machine.errors import InputError

BOS, USER_START, USER_END, ASSISTANT_START, ASSISTANT_END = CHAT_SPECIALS
ROLES = ("system", "developer", "user", "assistant")  # "developer" is OpenAI's newer "system"


# render_conversation's format as a Jinja chat template, for transformers' apply_chat_template
# on an exported folder (a test checks that the two agree). It renders text, whose special
# tokens the tokenizer then recognises. That suits a template's user, who writes the messages;
# this project itself renders ids, so that a message can never spell one.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{{- '<|bos|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ('system', 'developer') -%}"
    "{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|user_start|>' + ns.system + message['content'] + '<|user_end|><|assistant_start|>' -}}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}{{- message['content'] + '<|assistant_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}\n"
)


class ConversationError(InputError):
    """A conversation that cannot be rendered; the message says what is wrong with it."""


def check_conversation(messages: Any, ends_with: str = "assistant") -> list[tuple[str, str]]:
    """The user and assistant turns of OpenAI-style `messages`, alternating from the user's,
    with the system message folded into the first and the last turn `ends_with`'s
    ("assistant" to train, "user" to prompt for a reply)."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("its messages are not a non-empty list")
    system, turns = None, []
    for n, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise ConversationError(f"message {n} is not an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ConversationError(f"message {n} has the unknown role {role!r:.30}; roles "
                                    f"are {', '.join(ROLES)}")
        role = "system" if role == "developer" else role
        content = message_text(message.get("content"), n)
        # a reply may be empty in a prompt (a model can end its turn at once), never in
        # what a model is trained to say
        if not content.strip() and not (role == "assistant" and ends_with == "user"):
            raise ConversationError(f"message {n} ({role}) has empty content")
        if role == "system":
            if n != 1:
                raise ConversationError(f"message {n} is a system message; only the first "
                                        f"may be")
            system = content
            continue
        expected = "user" if not turns or turns[-1][0] == "assistant" else "assistant"
        if role != expected:
            raise ConversationError(f"message {n} is a second {role} turn in a row; user "
                                    f"and assistant turns alternate, the user's first")
        turns.append((role, content))
    if not turns or turns[-1][0] != ends_with:
        article = "an" if ends_with == "assistant" else "a"
        raise ConversationError(f"the conversation ends without {article} {ends_with} turn")
    return with_system(system, turns)


def message_text(content: Any, n: int) -> str:
    """Message n's text: its content, a string or a list of text parts (joined by newlines).
    Raises ConversationError for any other part (an image, say, because this model reads
    text alone) and for a string that is not text (data.text.check_text)."""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content, 1):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"of type {kind!r:.30}" if kind else f"a {type(part).__name__}"
                raise ConversationError(f"message {n}'s content part {i} is {what}, not "
                                        f"text; this model reads text alone: send "
                                        f"{{\"type\": \"text\", \"text\": ...}} parts only")
            if not isinstance(part.get("text"), str):
                raise ConversationError(f"message {n}'s content part {i} has no text (a "
                                        f"string in its field \"text\")")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise ConversationError(f"message {n}'s content is a {type(content).__name__}, not "
                                f"a string or a list of text parts")
    try:
        return check_text(content, f"message {n}'s content")
    except InputError as e:
        raise ConversationError(str(e)) from None


def with_system(system: str | None, turns: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The turns with the system text opening the first (user) turn, then a blank line."""
    if not system or not turns:
        return turns
    return [("user", f"{system}\n\n{turns[0][1]}"), *turns[1:]]


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The chat tokens' ids; InputError if the tokenizer lacks them, as a base model's does."""
    missing = [t for t in CHAT_SPECIALS if t not in tokenizer.specials]
    if missing:
        raise InputError(f"the tokenizer has no {', '.join(missing)}: it is a base model's; "
                         f"fine-tune it on conversations first (docs/chat.md)")
    return {t: tokenizer.specials[t] for t in CHAT_SPECIALS}


def user_turn(tokenizer: Tokenizer, text: str) -> list[int]:
    """A user turn and the opening of the reply that follows it."""
    s = special_ids(tokenizer)
    text = check_text(text, "a user turn")  # as is every text this module encodes
    return [s[USER_START], *tokenizer.encode(text), s[USER_END], s[ASSISTANT_START]]


def render_conversation(tokenizer: Tokenizer,
                        turns: list[tuple[str, str | list[int]]]) -> tuple[list[int], list[bool]]:
    """The conversation's ids, and for each whether SFT learns it: the assistant's text and
    the <|assistant_end|> that closes it (so the model learns to stop), and nothing else.
    An assistant turn may be given as the ids a model sampled (a chat's history), which are
    kept as they are, because text encoded again may split into other tokens."""
    s = special_ids(tokenizer)
    ids, mask = [s[BOS]], [False]
    for role, content in turns:
        if role == "user":
            part = user_turn(tokenizer, content)
            ids += part
            mask += [False] * len(part)
        else:
            reply = (tokenizer.encode(check_text(content, "an assistant turn"))
                     if isinstance(content, str) else content)
            part = [*reply, s[ASSISTANT_END]]
            ids += part
            mask += [True] * len(part)
    return ids, mask


def render_prompt(tokenizer: Tokenizer, turns: list[tuple[str, str | list[int]]]) -> list[int]:
    """The ids that ask for the next reply: the conversation up to its last user turn, and
    the <|assistant_start|> after it."""
    return render_conversation(tokenizer, turns)[0]


def assistant_mask(ids: np.ndarray, start_id: int, end_id: int) -> np.ndarray:
    """render_conversation's mask, read back from the ids: True from the token after each
    <|assistant_start|> through its <|assistant_end|>. Exact because text never encodes
    to a special id, so a prepared dataset needs no mask of its own on disk."""
    starts = np.cumsum(ids == start_id) - (ids == start_id)  # opened before this token
    ends = np.cumsum(ids == end_id) - (ids == end_id)  # closed before this token
    return starts > ends


class Conversations:
    """The conversations of a chat split, drawn whole: each row of a batch is one
    conversation from its <|bos|>, and the targets outside the assistant's turns are -1,
    which the loss ignores (render_conversation's mask, read back by assistant_mask).

    Rows are padded, not packed: each is as long as the batch's longest conversation, and a
    shorter row is filled out with <|bos|> and targets of -1. Each row then attends to its own
    conversation only, from position 0 as in the chat REPL, with no attention mask to
    build; conversations are short, so the padding costs little (docs/chat.md measures
    it). A conversation longer than block_size + 1 tokens is cut, and one whose first
    learned token falls past the cut is left out, so every row has targets.

    `ids` is the whole split (`where` names it), read into memory once, because chat
    datasets are small next to pretraining's."""

    def __init__(self, ids: np.ndarray, where: str, specials: dict[str, int],
                 block_size: int) -> None:
        self.ids = ids.astype(np.int64)
        self.bos, self.block_size = specials[BOS], block_size
        learned = assistant_mask(self.ids, specials[ASSISTANT_START], specials[ASSISTANT_END])
        self.targets = np.where(learned, self.ids, -1)
        starts = np.flatnonzero(self.ids == self.bos)
        ends = np.append(starts[1:], len(self.ids))
        keep = [self.learns_within(s, e, learned) for s, e in zip(starts, ends, strict=True)]
        self.spans = [(int(s), int(min(e, s + block_size + 1)))
                      for s, e, k in zip(starts, ends, keep, strict=True) if k]
        cut = sum(1 for s, e in zip(starts, ends, strict=True) if e - s > block_size + 1)
        left_out = len(starts) - len(self.spans)
        # what the cut costs, for the run to report; None when every conversation fits
        self.note = (f"note: {cut:,} of {len(starts):,} conversations in {where} are "
                     f"longer than block_size + 1 ({block_size + 1}) tokens and are cut, "
                     f"{left_out:,} of them before any reply, which leaves them out"
                     if cut else None)
        if not self.spans:
            raise DataError(f"{where} has no conversation with an assistant turn within "
                            f"block_size ({block_size}) tokens; raise block_size")

    def learns_within(self, start: int, end: int, learned: np.ndarray) -> bool:
        return bool(learned[start + 1:min(end, start + self.block_size + 1)].any())

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.randint(len(self.spans), (batch_size,), generator=generator).tolist()
        spans = [self.spans[i] for i in picks]
        T = max(end - start for start, end in spans) - 1
        x = np.full((batch_size, T), self.bos, dtype=np.int64)
        y = np.full((batch_size, T), -1, dtype=np.int64)
        for row, (start, end) in enumerate(spans):
            x[row, :end - start - 1] = self.ids[start:end - 1]
            y[row, :end - start - 1] = self.targets[start + 1:end]
        return torch.from_numpy(x), torch.from_numpy(y)


def with_specials(meta: dict, tokens: tuple[str, ...]) -> dict:
    """The description of this tokenizer with the special tokens it lacks added after its
    vocabulary, so every text keeps its ids and only the new tokens get new ones."""
    if not tokens:
        return meta
    tokenizer = load_tokenizer(meta)
    missing = tuple(t for t in tokens if t not in tokenizer.specials)
    if not missing:
        return meta
    if meta["kind"] != "hf":
        return {**meta, "vocab_size": meta["vocab_size"] + len(missing),
                "specials": [*meta.get("specials", []), *missing]}
    from tokenizers import AddedToken

    from data.hf_tokenizer import HFTokenizer
    backend = tokenizer.backend
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    return HFTokenizer(backend.to_str()).to_meta()
