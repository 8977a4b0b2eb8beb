"""Request bodies read as strict JSON (RFC 8259), in one place for every route of the server.

Usage:
    app.router.route_class = StrictJSONRoute    # before the routes are declared
    strict_json(b'{"n": 1}')                     # {"n": 1}, or NotJSON naming the problem

Python's json module reads more than JSON: NaN, Infinity and -Infinity, a number past a
float's range as inf, and an object that gives a key twice, of which the last value wins.
Every body is read here instead, before FastAPI checks its fields, so that a field the
server ignores (user, metadata, a message's name, an unknown key) is held to JSON as strictly
as one it reads, and no request is answered from a guess at which of two values was meant.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from serving.api import path_name

FINITE = "send a finite number"


class NotJSON(ValueError):
    """A body that is not strict JSON. The message names the place in the body and the fix;
    param is the top-level field at fault, where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Misfit:
    """What the parser leaves where a value is not JSON, so that the place can be named
    after the parse: the value as the body spells it (None for a key given twice, which is
    `key`), and what is wrong with it, to follow "is"."""

    def __init__(self, shown: str | None, problem: str, key: str | None = None) -> None:
        self.shown, self.problem, self.key = shown, problem, key


def strict_json(body: bytes) -> Any:
    """The JSON value of a request body; NotJSON for a body that is not UTF-8, not JSON, nested
    deeper than Python reads, or that holds NaN, Infinity, a number out of a float's range or
    past Python's digits for an integer, or an object that gives a key twice."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise NotJSON("the body is not UTF-8 text; send a JSON object encoded in UTF-8") from None
    misfits = []  # whether any value needs naming, so that a good body is not walked

    def misfit(shown: str | None, problem: str, key: str | None = None) -> Misfit:
        misfits.append(True)
        return Misfit(shown, problem, key)

    def constant(name: str) -> Misfit:
        return misfit(name, f"not JSON (RFC 8259 has no NaN or Infinity); {FINITE}")

    def number(digits: str) -> float | Misfit:
        value = float(digits)
        return value if math.isfinite(value) else misfit(
            digits, f"past the range of a float; {FINITE}")

    def unique(pairs: list[tuple[str, Any]]) -> dict | Misfit:
        record: dict[str, Any] = {}
        for key, value in pairs:
            if key in record:
                return misfit(None, "given twice; send each key once", key)
            record[key] = value
        return record
    if text.startswith("\ufeff"):
        raise NotJSON("the body starts with a byte-order mark, which JSON text sent over a "
                      "network may not (RFC 8259); send it without")
    try:
        # integers are left to the parser's own C code, because a body may hold a megabyte of
        # token ids and this runs on the event loop
        value = json.loads(text, parse_constant=constant, parse_float=number,
                           object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise NotJSON(f"the body is not valid JSON ({e.msg}, line {e.lineno} column "
                      f"{e.colno}); send a JSON object") from None
    except ValueError:  # an integer past sys.get_int_max_str_digits()
        raise NotJSON(f"the body holds an integer longer than this server reads (past "
                      f"{sys.get_int_max_str_digits():,} digits); {FINITE} of fewer digits") from None
    except RecursionError:
        raise NotJSON("the body nests lists or objects too deeply to read; send a flatter JSON "
                      "object") from None
    if misfits:
        raise first_misfit(value)
    return value


def first_misfit(value: Any) -> NotJSON:
    """The error for the first Misfit in `value`, in the order of the body's text, named by
    its path ("messages[0].role"). The walk keeps its own stack, because a body may nest as
    deep as the parser reads."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        here, path = stack.pop()
        if isinstance(here, Misfit):
            if here.key is not None:  # "messages[0].role is given twice"
                name = path_name([*path, here.key])
                return NotJSON(f"{name} is {here.problem}", param=str(path[0] if path else here.key))
            if not path:  # "the body is NaN, not JSON"
                return NotJSON(f"the body is {here.shown}, {here.problem}")
            return NotJSON(f"{path_name(path)}: {here.shown} is {here.problem}",
                           param=path[0] if isinstance(path[0], str) else None)
        items = (here.items() if isinstance(here, dict) else
                 enumerate(here) if isinstance(here, list) else ())
        stack.extend((item, [*path, key]) for key, item in reversed(list(items)))
    raise AssertionError("a misfit was recorded but not found")


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose body FastAPI reads through strict_json. FastAPI reports an error raised
    while it reads a body as an HTTPException caused by it, which serving/app.py answers
    with NotJSON's message and param."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))
        return strict
