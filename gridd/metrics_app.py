"""Prometheus /metrics (and /healthz) as a tiny ASGI app over an injected registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gridd.http.asgi import ASGIApp, Receive, Scope, Send, send_simple


def make_metrics_app(registry: CollectorRegistry) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            await send_simple(send, 405, b"method not allowed\n", extra_headers=[(b"allow", b"GET, HEAD")])
        elif path == "/metrics":
            await send_simple(send, 200, generate_latest(registry), CONTENT_TYPE_LATEST.encode())
        elif path == "/healthz":
            await send_simple(send, 200, b"ok\n")
        else:
            await send_simple(send, 404, b"not found\n")

    return app
