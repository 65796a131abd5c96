"""Prometheus /metrics (and /healthz) as a tiny ASGI app over an injected registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest


async def send_simple(send, status: int, body: bytes, content_type: bytes = b"text/plain; charset=utf-8",
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def make_metrics_app(registry: CollectorRegistry):
    async def app(scope, receive, send):
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
