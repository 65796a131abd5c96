"""ASGI types and the small pieces both backends and gridd's apps share.

ClientDisconnected is what send() raises once the client is gone; answer_lifespan answers the
lifespan protocol for apps that keep no start-up state; send_simple sends a whole response
with a Content-Length in two messages.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

__all__ = [
    "ASGIApp",
    "ClientDisconnected",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "answer_lifespan",
    "only_disconnects",
    "reason_phrase",
    "send_simple",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientDisconnected(OSError):
    """Raised by send() once the client is gone (ASGI spec 2.4: an OSError subclass)."""


def only_disconnects(exc: BaseException) -> bool:
    """True for ClientDisconnected, or a group holding nothing else (an app that let the
    client's departure escape, which is not worth a log line)."""
    if isinstance(exc, ClientDisconnected):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(ClientDisconnected)
        return rest is None
    return False


def reason_phrase(status: int) -> str:
    """The status line's reason phrase ("Error" for a code HTTP does not name)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge the ASGI lifespan protocol (gridd's apps keep no start-up state in it)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def send_simple(send: Send, status: int, body: bytes,
                      content_type: bytes = b"text/plain; charset=utf-8",
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole response: its head (Content-Type, Content-Length, ``extra_headers``), then ``body``."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})
