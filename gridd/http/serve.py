"""serve_asgi: serve an ASGI app on binds with one of two backends, until cancelled or drained.

task_status.started() receives the bound addresses ("http://host:port", "http://[::1]:port",
"unix:/path"), so port 0 works in tests. Backends: "h11" (default, h11_server) and
"hypercorn" (hypercorn_backend). Both share the limits (limits.py) and the drain contract:
when `stop_accepting` is set the listeners close, in-flight requests finish, idle keep-alive
connections close, and serve_asgi returns once no connection is left. The caller bounds that
grace period with move_on_after.
"""

from __future__ import annotations

from typing import Literal

import trio

from gridd.http.asgi import ASGIApp
from gridd.http.h11_server import serve_h11
from gridd.http.hypercorn_backend import serve_hypercorn
from gridd.http.limits import (
    DEFAULT_BODY_DEADLINE_S,
    DEFAULT_BODY_IDLE_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    ServerLimits,
)

__all__ = ["serve_asgi"]


async def serve_asgi(
    app: ASGIApp,
    binds: list[str],
    *,
    server: Literal["h11", "hypercorn"] = "h11",
    stop_accepting: trio.Event | None = None,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    body_idle_s: float = DEFAULT_BODY_IDLE_S,
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` (ASGI 3, http scopes only) on `binds` until cancelled or drained.

    binds: "host:port", "[v6]:port" or "unix:/path". task_status.started() gets the bound
    addresses once every listener accepts. stop_accepting: when set, stop accepting, let
    in-flight requests finish, close idle connections, then return (bound it with
    move_on_after). keep_alive_s is a per-connection policy, not a bound on this call: how long
    a connection may wait for its next complete request head. max_body_bytes: larger bodies get
    413 and never reach the app (declared Content-Length) or end in http.disconnect (chunked).
    max_header_bytes: larger request heads get 431. body_idle_s / body_deadline_s: a body
    stalled that long, or not complete that long after its head, gets 408. max_connections
    (per listener) and max_buffered_bytes (request bodies held across connections): see
    DEFAULT_MAX_CONNECTIONS and DEFAULT_MAX_BUFFERED_BYTES; the hypercorn backend has neither.
    reuse_port: bind TCP listeners with SO_REUSEPORT, so other processes may serve the same
    address (h11 backend only).
    """
    limits = ServerLimits(keep_alive_s, max_body_bytes, max_header_bytes, body_idle_s, body_deadline_s,
                          max_connections, max_buffered_bytes)
    if server == "h11":
        await serve_h11(app, binds, stop_accepting=stop_accepting, limits=limits, reuse_port=reuse_port,
                        task_status=task_status)
    elif server == "hypercorn":
        if reuse_port:
            raise ValueError("reuse_port needs the h11 backend")
        await serve_hypercorn(
            app, binds, stop_accepting=stop_accepting, limits=limits, task_status=task_status
        )
    else:
        raise ValueError(f"unknown HTTP server backend {server!r}")
