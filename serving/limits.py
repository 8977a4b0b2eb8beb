"""A cap on request bodies, before any of one is parsed.

Usage:
    app.add_middleware(BodyLimit, limit=1 << 20)      # 413 in OpenAI's shape past 1 MB

A body whose stated length is over the limit is refused before it is read; one sent in chunks (no
Content-Length) is counted as it arrives and refused at the chunk that passes the limit,
so no request can make the server hold more than the limit.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api import error_body


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    def message(self) -> str:
        return (f"the request body is over {self.limit // (1 << 20)} MB, the most this server "
                f"reads; send a shorter prompt")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            status = 413 if length.isdigit() else 400
            text = self.message() if status == 413 else "Content-Length is not a number"
            body = json.dumps(error_body(text)).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # FastAPI passes an HTTPException on as it is
                raise HTTPException(413, self.message())
            return message

        await self.app(scope, counted, send)
