"""The gateway's OpenAI-compatible front: one ASGI app over an injected Router.

    POST /v1/chat/completions, /v1/completions, /v1/embeddings   routed and forwarded
    GET  /v1/models                                              router.models()
    GET  /healthz  /readyz  /metrics                             alive / router.ready() / registry

One inference request: read the body (bounded), check PIN_HEADER (another site's name: 421),
take the model, ask the router once, then answer the decision or forward it (forwarding.py:
the upstream exchange, its bounds and its one retry). Nothing here counts requests in flight
(the spec: the gateway keeps no count of its own requests in flight), and nothing here
routes: the router decides. Bounds: front_limits.py; error answers: front_errors.py; series:
front_metrics.py.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import msgspec
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gridd.gateway.forwarding import Exchange, Forwarder
from gridd.gateway.front_errors import retry_after_seconds, send_error
from gridd.gateway.front_limits import FrontLimits
from gridd.gateway.front_metrics import NO_SITE, OTHER_MODEL, CountsPool, FrontMetrics
from gridd.gateway.router import PIN_HEADER, Forward, Router, Shed, Unavailable, UnknownModel
from gridd.gateway.upstream_httpx import as_upstream
from gridd.gateway.upstream_request import Upstream
from gridd.http.asgi import ClientDisconnected, Receive, Scope, Send, send_simple

__all__ = ["INFERENCE_PATHS", "FrontApp", "make_front_app"]

logger = logging.getLogger("gridd.gateway.front")


INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_GET_PATHS = frozenset({"/v1/models", "/healthz", "/readyz", "/metrics"})
_PIN = PIN_HEADER.encode("ascii")

_json = msgspec.json.Encoder()


class _RequestHead(msgspec.Struct):
    """The one field the front reads; every other field passes through untouched."""

    model: Any = None


_decode_head = msgspec.json.Decoder(_RequestHead).decode


def _shown(model: str) -> str:
    """A client-supplied model name as it may appear in an error message (bounded)."""
    return model if len(model) <= 200 else model[:200] + "..."


class _ClientGone(Exception):
    """The client went away before the request body was read."""


# ---------------------------------------------------------------------------------------------


class FrontApp:
    """The ASGI app; build it with make_front_app."""

    def __init__(self, router: Router, transport: Upstream, registry: CollectorRegistry, *,
                 rng: random.Random, limits: FrontLimits, ingress_transport: Upstream | None,
                 created_unix: int) -> None:
        self.router = router
        self.transport = transport
        self.ingress_transport = ingress_transport if ingress_transport is not None else transport
        self.registry = registry
        self.rng = rng
        self.limits = limits
        self.created_unix = created_unix
        self.metrics = FrontMetrics()
        for upstream, given in (("provider", self.transport), ("ingress", self.ingress_transport)):
            if isinstance(given, CountsPool) and given not in self.metrics.pools.values():
                self.metrics.pools[upstream] = given
        registry.register(self.metrics)
        self.forwarder = Forwarder(router, self.transport, self.ingress_transport, self.metrics, rng=rng,
                                   limits=limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        method = scope["method"]
        try:
            if path in INFERENCE_PATHS:
                if method == "POST":
                    await self._inference(scope, receive, send)
                else:
                    await send_error(send, 405, f"{method} is not allowed on {path}; use POST",
                                     type_="invalid_request_error", code="method_not_allowed",
                                     extra=[(b"allow", b"POST")])
            elif path in _GET_PATHS:
                if method in ("GET", "HEAD"):
                    await self._read_only(path, send)
                else:
                    await send_error(send, 405, f"{method} is not allowed on {path}; use GET",
                                     type_="invalid_request_error", code="method_not_allowed",
                                     extra=[(b"allow", b"GET, HEAD")])
            else:
                await send_error(send, 404, f"Invalid URL ({method} {path})", type_="invalid_request_error",
                                 code="not_found")
        except ClientDisconnected:
            return

    async def _read_only(self, path: str, send: Send) -> None:
        if path == "/v1/models":
            body = _json.encode({"object": "list", "data": [
                {"id": model, "object": "model", "created": self.created_unix, "owned_by": "gridd"}
                for model in self.router.models()]})
            await send_simple(send, 200, body, b"application/json")
        elif path == "/metrics":
            await send_simple(send, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST.encode())
        elif path == "/healthz":
            await send_simple(send, 200, b"ok\n")
        elif (reason := self.router.not_ready_reason()) is None:
            await send_simple(send, 200, b"ready\n")
        else:
            await send_simple(send, 503, f"not ready: {reason}\n".encode())

    # -- inference ------------------------------------------------------------------------------

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it exceeds the limit; _ClientGone on a disconnect."""
        limit = self.limits.max_body_bytes
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone()
        body = message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return body
        chunks, size = [body], len(body)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _inference(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = trio.current_time()
        metrics = self.metrics
        pin: str | None = None
        for name, value in scope["headers"]:
            if name == _PIN:
                pin = value.decode("latin-1")
        site = self.router.site
        if pin is not None and pin != site:
            metrics.request(OTHER_MODEL, NO_SITE, "misdirected")
            await send_error(send, 421,
                             f"this gateway serves site {site!r}, the request is pinned to {pin!r}",
                             type_="invalid_request_error", code="misdirected_request")
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            metrics.request(OTHER_MODEL, NO_SITE, "client_closed")
            return
        if body is None:
            metrics.request(OTHER_MODEL, NO_SITE, "too_large")
            await send_error(send, 413, f"request body larger than {self.limits.max_body_bytes} bytes",
                             type_="invalid_request_error", code="request_too_large")
            return
        try:
            model = _decode_head(body).model
        except msgspec.ValidationError:
            metrics.request(OTHER_MODEL, NO_SITE, "bad_request")
            await send_error(send, 400, "the request body must be a JSON object",
                             type_="invalid_request_error", code="invalid_json")
            return
        except (msgspec.DecodeError, RecursionError) as exc:
            metrics.request(OTHER_MODEL, NO_SITE, "bad_request")
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            await send_error(send, 400, f"the request body is not valid JSON: {detail}",
                             type_="invalid_request_error", code="invalid_json")
            return
        if not isinstance(model, str) or not model:
            metrics.request(OTHER_MODEL, NO_SITE, "bad_request")
            await send_error(send, 400, "`model` is required and must be a non-empty string",
                             type_="invalid_request_error", code="missing_model", param="model")
            return

        decision = self.router.decide(model, pinned_site=pin)
        if isinstance(decision, Unavailable) and decision.cause == "no_operator_data":
            # A restarted gateway serves before its first poll lands: wait for it (bounded)
            # rather than turn away the first second of traffic. The wait ends at once when
            # the gateway has had data before (then the data is lost, and the 503 is right).
            with trio.move_on_after(self.limits.first_data_wait_s):
                await self.router.first_routing_data()
                decision = self.router.decide(model, pinned_site=pin)
        match decision:
            case Forward():
                exchange = Exchange(decision.site)
                await self.forwarder.forward(scope, receive, send, exchange, decision, model, pin, body,
                                             started)
                metrics.request(model, exchange.site, exchange.outcome or "client_closed")
            case Shed(retry_after_s=hint):
                metrics.shed(model)
                metrics.request(model, NO_SITE, "shed")
                await send_error(send, 429, f"every site serving {model!r} is saturated; retry later",
                                 type_="rate_limit_exceeded", code="model_saturated",
                                 retry_after=retry_after_seconds(hint, self.rng))
            case Unavailable(retry_after_s=hint, cause=cause):
                metrics.unavailable_answer(model)
                metrics.request(model, NO_SITE, "unavailable")
                code = "no_routing_data" if cause == "no_operator_data" else "model_unavailable"
                await send_error(send, 503, self._unavailable_message(model, cause),
                                 type_="service_unavailable", code=code,
                                 retry_after=retry_after_seconds(hint, self.rng))
            case UnknownModel():
                metrics.request(OTHER_MODEL, NO_SITE, "unknown_model")
                await send_error(send, 404, f"The model `{_shown(model)}` does not exist",
                                 type_="invalid_request_error", code="model_not_found", param="model")

    def _unavailable_message(self, model: str, cause: str) -> str:
        if cause == "no_operator_data":
            # A broken setup (operator unreachable, wrong URL or certificate) must not look
            # like a wrong model name: say what is missing.
            return self.router.not_ready_reason() or "no routing data from the operator"
        if cause == "silent":
            return f"no site serving {model!r} has reported load recently; retry later"
        if cause == "strategy":
            return f"every site serving {model!r} is over a bound of its routing strategy; retry later"
        return f"the model {model!r} exists but no site can serve it now"


_DEFAULT_LIMITS = FrontLimits()


def make_front_app(router: Router, transport: object, registry: CollectorRegistry, *,
                   rng: random.Random, limits: FrontLimits = _DEFAULT_LIMITS,
                   ingress_transport: object | None = None,
                   created_unix: int | None = None) -> FrontApp:
    """The OpenAI front as an ASGI app (serve it with gridd.http.serve.serve_asgi).

    router: routing decisions (the gateway store). transport: what this site's providers are
    reached through: the pooled client from upstream_client.make_upstream_client (the caller
    closes it), or any httpx transport (tests: mock and ASGI transports; upstream_httpx).
    registry: the front registers its collector here and serves it on GET /metrics. rng:
    Retry-After jitter. limits: bounds. ingress_transport: the same, for other sites' ingress
    (e.g. with the gateway's mTLS identity and the grid CA); defaults to ``transport``.
    created_unix: ``created`` of every /v1/models entry (default: now).
    """
    return FrontApp(router, as_upstream(transport), registry, rng=rng, limits=limits,
                    ingress_transport=None if ingress_transport is None else as_upstream(ingress_transport),
                    created_unix=int(time.time()) if created_unix is None else created_unix)
