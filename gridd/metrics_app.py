"""Prometheus /metrics (and /healthz) as a tiny ASGI app over an injected registry."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
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


def labelled_counter(name: str, documentation: str, labels: Sequence[str],
                     values: Iterable[tuple[str | tuple[str, ...], float]]) -> CounterMetricFamily:
    """A counter family built at scrape time from (label value or values, count) pairs, in
    the order given (collectors pass their dicts' items, sorted where the order matters)."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    for key, value in values:
        family.add_metric([key] if isinstance(key, str) else list(key), value)
    return family
