"""The hypercorn backend: hypercorn's trio worker, kept for HTTP/2 or whenever a second opinion
is wanted, wrapped (HypercornAdapter) so that it keeps the h11 backend's contract where it can
(docs/http-serving.md, "Backend differences that remain")."""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import cast

import trio

from gridd.http.asgi import (
    ASGIApp,
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    answer_lifespan,
    only_disconnects,
    reason_phrase,
)
from gridd.http.limits import ServerLimits, declared_length, head_size
from gridd.http.listeners import parse_bind

__all__ = ["HypercornAdapter", "serve_hypercorn"]

logger = logging.getLogger("gridd.http")


async def _send_plain(send: Send, status: int) -> None:
    body = f"{status} {reason_phrase(status)}\n".encode("ascii")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode("ascii")),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HypercornAdapter:
    """Gives hypercorn the h11 backend's contract: no lifespan reaches the app, the same head
    limit (431), the same body limit (413 on a declared or streamed excess, http.disconnect to the
    app for the latter) and ClientDisconnected from send() once the request is abandoned."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        raw_target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        if head_size(scope["method"].encode("ascii"), raw_target, scope["headers"]) > self.max_header_bytes:
            await _send_plain(send, 431)
            return
        declared = declared_length(scope["headers"])
        if declared is not None and declared > limit:
            await _send_plain(send, 413)
            return
        received = 0
        over_limit = False
        disconnected = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, over_limit, disconnected
            if over_limit or disconnected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over_limit = True
                    return {"type": "http.disconnect"}
            elif message["type"] == "http.disconnect":
                disconnected = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            # hypercorn drops sends after a disconnect silently; the contract is to raise.
            if over_limit or disconnected:
                raise ClientDisconnected("client disconnected")
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception as exc:
            if not ((over_limit or disconnected) and only_disconnects(exc)):
                raise
        if over_limit and not started:
            await _send_plain(send, 413)


def _normalize_hypercorn_url(url: str) -> str:
    # hypercorn reports a unix socket as "http://unix:/path".
    _, _, rest = url.partition("://")
    return rest if rest.startswith("unix:") else url


async def serve_hypercorn(
    app: ASGIApp,
    binds: list[str],
    *,
    stop_accepting: trio.Event | None,
    limits: ServerLimits,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from hypercorn.typing import ASGIFramework

    for bind in binds:
        parse_bind(bind)  # same accepted syntax as the h11 backend
    config = Config()
    config.bind = list(binds)
    config.accesslog = None
    config.errorlog = logger
    config.keep_alive_timeout = limits.keep_alive_s
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.include_server_header = False
    # The caller bounds the drain with move_on_after; hypercorn must not impose its own.
    config.graceful_timeout = math.inf
    shutdown_trigger = stop_accepting.wait if stop_accepting is not None else None
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(
                serve,
                # hypercorn types scopes and messages as TypedDicts; the adapter takes the same
                # dicts as plain mappings (asgi.Scope, asgi.Message).
                cast(ASGIFramework, HypercornAdapter(app, limits.max_body_bytes, limits.max_header_bytes)),
                config,
                shutdown_trigger=shutdown_trigger,
                mode="asgi",
            )
        )
        task_status.started([_normalize_hypercorn_url(url) for url in urls])
