"""The gateway's OpenAI-compatible front: one ASGI app over an injected Router.

    POST /v1/chat/completions, /v1/completions, /v1/embeddings   routed and forwarded
    GET  /v1/models                                              router.models()
    GET  /healthz  /readyz  /metrics                             alive / router.ready() / registry

One inference request: read the body (bounded), check PIN_HEADER (another site's name: 421),
take the model, ask the router once, then answer the decision or forward. A forward streams
the upstream answer back chunk by chunk; a second task waits for the client to go away and
cancels the whole exchange, which closes the upstream connection so the backend frees the
sequence at once. Nothing here counts requests in flight (the spec: the gateway keeps no
count of its own requests in flight), and nothing here routes: the router decides.

Bounds (STYLE 3; docs/front.md), all trio cancel scopes, none inside httpx: ``connect_s``
until a connection is ready; from there to the first body byte the provider's ``timeout_s``
(or the front's defaults); between body chunks ``stream_idle_s``. A retry on the next
candidate happens at most once, and only while nothing of the answer reached the client.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gridd.gateway.forward import (
    UpstreamBody,
    UpstreamError,
    UpstreamTarget,
    open_upstream,
    request_headers,
    response_headers,
    upstream_target,
)
from gridd.gateway.router import PIN_HEADER, Forward, Router, Shed, Unavailable, UnknownModel
from gridd.http.asgi import ClientDisconnected, Receive, Scope, Send, send_simple

__all__ = ["FrontLimits", "FrontMetrics", "make_front_app", "retry_after_seconds"]

logger = logging.getLogger("gridd.gateway.front")


INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_GET_PATHS = frozenset({"/v1/models", "/healthz", "/readyz", "/metrics"})
_PIN = PIN_HEADER.encode("ascii")
SERVED_BY = b"x-gridd-served-by"
SSE_DONE = b"data: [DONE]\n\n"
"""The last event of an OpenAI-compatible stream."""

# Retry-After: the decision's hint clamped to [1, 60] s, plus 0..25 % jitter from the injected
# rng so clients told to come back do not return in step, rounded up to whole seconds.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0
RETRY_AFTER_JITTER = 0.25
# Closing an upstream response is shielded from cancellation (a client that left must still
# free the backend) and bounded by this.
_CLOSE_S = 1.0
_TARGET_CACHE_SIZE = 1024

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
OTHER_MODEL = "other"
NO_SITE = "none"


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """The front's bounds (docs/front.md, "Timeouts")."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body read; more is 413. Serve with serve_asgi max_body_bytes above it."""
    connect_s: float = 5.0
    """Waiting for a pooled connection plus TCP (and TLS) connect; then the next candidate."""
    upstream_timeout_s: float = 300.0
    """Connected to first body byte, for a local provider that sets no ``timeout_s``."""
    remote_timeout_s: float = 310.0
    """Connected to first body byte at another site's gateways: above their own 300 s default,
    so the remote gateway's answer (504) arrives before this gives up."""
    stream_idle_s: float = 60.0
    """Between two body chunks relayed (either side stalling); the stream is then cut."""
    upstream_retry_after_s: float = 1.0
    """Retry-After hint for 502/504 when no decision gave one."""
    first_data_wait_s: float = 2.0
    """A request that comes before the gateway's first routing data (just started or
    restarted: its first poll is under way) waits this long for it before its 503; once the
    gateway has had data, a 503 for lost data is answered at once."""


def retry_after_seconds(retry_after_s: float, rng: random.Random) -> int:
    """Whole seconds for a Retry-After header: clamp, jitter +0..25 %, round up."""
    base = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, retry_after_s))
    return math.ceil(base * (1.0 + RETRY_AFTER_JITTER * rng.random()))


# ---------------------------------------------------------------------------------------------
# Metrics: plain counters on the request path, families built at scrape time (STYLE 11).


class _Histogram:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*LATENCY_BUCKETS, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


class FrontMetrics:
    """The front's series. Labels are bounded: ``model`` is a model the router knows (any
    other name is ``other``), ``site`` a site a decision named (``none`` when no site took the
    request), ``outcome`` and ``reason`` come from fixed sets (docs/front.md)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.sheds: dict[str, int] = {}
        self.unavailable: dict[str, int] = {}
        self.upstream_latency: dict[str, _Histogram] = {}
        self.first_byte: dict[str, _Histogram] = {}
        self.pools: dict[str, Any] = {}
        """Upstream transports by ``upstream`` label (provider, ingress) whose pool_counts()
        give connections opened and requests sent (forward.UpstreamTransport)."""

    def request(self, model: str, site: str, outcome: str) -> None:
        key = (model, site, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def retry(self, reason: str) -> None:
        self.retries[reason] = self.retries.get(reason, 0) + 1

    def shed(self, model: str) -> None:
        self.sheds[model] = self.sheds.get(model, 0) + 1

    def unavailable_answer(self, model: str) -> None:
        self.unavailable[model] = self.unavailable.get(model, 0) + 1

    def observe_upstream_latency(self, site: str, seconds: float) -> None:
        hist = self.upstream_latency.get(site)
        if hist is None:
            hist = self.upstream_latency[site] = _Histogram()
        hist.observe(seconds)

    def observe_first_byte(self, site: str, seconds: float) -> None:
        hist = self.first_byte.get(site)
        if hist is None:
            hist = self.first_byte[site] = _Histogram()
        hist.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "gridd_gateway_requests", "Inference requests answered by this gateway's front, by outcome.",
            labels=["model", "site", "outcome"])
        for (model, site, outcome), value in list(self.requests.items()):
            requests.add_metric([model, site, outcome], value)
        yield requests
        retries = CounterMetricFamily(
            "gridd_gateway_retries", "Requests sent to a second candidate after the first failed before "
            "any byte reached the client, by the first failure's reason.", labels=["reason"])
        for reason, value in list(self.retries.items()):
            retries.add_metric([reason], value)
        yield retries
        sheds = CounterMetricFamily("gridd_gateway_sheds", "Requests answered 429 because the model sheds.",
                                    labels=["model"])
        for model, value in list(self.sheds.items()):
            sheds.add_metric([model], value)
        yield sheds
        unavailable = CounterMetricFamily(
            "gridd_gateway_unavailable", "Requests answered 503 because no candidate of the model can serve.",
            labels=["model"])
        for model, value in list(self.unavailable.items()):
            unavailable.add_metric([model], value)
        yield unavailable
        opened = CounterMetricFamily(
            "gridd_gateway_upstream_connections_opened", "Connections opened to upstreams (providers, or other "
            "sites' ingress); compare with gridd_gateway_upstream_requests_sent for the reuse.",
            labels=["upstream"])
        sent = CounterMetricFamily("gridd_gateway_upstream_requests_sent", "Requests sent to upstreams.",
                                   labels=["upstream"])
        for upstream, pool in list(self.pools.items()):
            connections, requests = pool.pool_counts()
            opened.add_metric([upstream], connections)
            sent.add_metric([upstream], requests)
        yield opened
        yield sent
        for name, doc, hists in (
            ("gridd_gateway_upstream_latency_seconds",
             "From sending a request upstream to its response headers, per site that answered.",
             self.upstream_latency),
            ("gridd_gateway_time_to_first_byte_seconds",
             "From the request's arrival to the first response body byte sent to the client, per site.",
             self.first_byte),
        ):
            family = HistogramMetricFamily(name, doc, labels=["site"])
            for site, hist in list(hists.items()):
                family.add_metric([site], hist.buckets(), hist.total)
            yield family


# ---------------------------------------------------------------------------------------------
# Errors to clients: {"error": {"message", "type", "param", "code"}} (DESIGN 5)

_json = msgspec.json.Encoder()


class _RequestHead(msgspec.Struct):
    """The one field the front reads; every other field passes through untouched."""

    model: Any = None


_decode_head = msgspec.json.Decoder(_RequestHead).decode


async def _send_error(send: Send, status: int, message: str, *, type_: str, code: str | None,
                      param: str | None = None, retry_after: int | None = None,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = _json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})
    headers = list(extra or ())
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode("ascii")))
    await send_simple(send, status, body, b"application/json", headers)


def _shown(model: str) -> str:
    """A client-supplied model name as it may appear in an error message (bounded)."""
    return model if len(model) <= 200 else model[:200] + "..."


class _ClientGone(Exception):
    """The client went away before the request body was read."""


async def _cancel_on_disconnect(receive: Receive, exchange_scope: trio.CancelScope,
                                 watching: trio.CancelScope) -> None:
    with watching:
        while (await receive())["type"] != "http.disconnect":
            pass
        exchange_scope.cancel()


class _Exchange:
    """One forwarded request: what it ended as (for its metric line), and the disconnect
    watcher's scope, stopped as the last body message goes out (the watcher has nothing left
    to guard, and ends during that send instead of costing a scheduler pass afterwards)."""

    __slots__ = ("site", "outcome", "watching", "stream_done")

    def __init__(self, site: str) -> None:
        self.site = site
        self.outcome: str | None = None
        self.watching = trio.CancelScope()
        self.stream_done = False
        """The OpenAI stream terminator reached the client: a hang-up after it is not a loss."""


# ---------------------------------------------------------------------------------------------


class FrontApp:
    """The ASGI app; build it with make_front_app."""

    def __init__(self, router: Router, transport: httpx.AsyncBaseTransport, registry: CollectorRegistry, *,
                 rng: random.Random, limits: FrontLimits, ingress_transport: httpx.AsyncBaseTransport | None,
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
            if hasattr(given, "pool_counts") and given not in self.metrics.pools.values():
                self.metrics.pools[upstream] = given
        registry.register(self.metrics)
        self._targets: dict[tuple[Any, ...], tuple[Any, UpstreamTarget]] = {}

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
                    await _send_error(send, 405, f"{method} is not allowed on {path}; use POST",
                                      type_="invalid_request_error", code="method_not_allowed",
                                      extra=[(b"allow", b"POST")])
            elif path in _GET_PATHS:
                if method in ("GET", "HEAD"):
                    await self._read_only(path, send)
                else:
                    await _send_error(send, 405, f"{method} is not allowed on {path}; use GET",
                                      type_="invalid_request_error", code="method_not_allowed",
                                      extra=[(b"allow", b"GET, HEAD")])
            else:
                await _send_error(send, 404, f"Invalid URL ({method} {path})", type_="invalid_request_error",
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
            await _send_error(send, 421, f"this gateway serves site {site!r}, the request is pinned to {pin!r}",
                              type_="invalid_request_error", code="misdirected_request")
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            metrics.request(OTHER_MODEL, NO_SITE, "client_closed")
            return
        if body is None:
            metrics.request(OTHER_MODEL, NO_SITE, "too_large")
            await _send_error(send, 413, f"request body larger than {self.limits.max_body_bytes} bytes",
                              type_="invalid_request_error", code="request_too_large")
            return
        try:
            model = _decode_head(body).model
        except msgspec.ValidationError:
            metrics.request(OTHER_MODEL, NO_SITE, "bad_request")
            await _send_error(send, 400, "the request body must be a JSON object",
                              type_="invalid_request_error", code="invalid_json")
            return
        except (msgspec.DecodeError, RecursionError) as exc:
            metrics.request(OTHER_MODEL, NO_SITE, "bad_request")
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            await _send_error(send, 400, f"the request body is not valid JSON: {detail}",
                              type_="invalid_request_error", code="invalid_json")
            return
        if not isinstance(model, str) or not model:
            metrics.request(OTHER_MODEL, NO_SITE, "bad_request")
            await _send_error(send, 400, "`model` is required and must be a non-empty string",
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
                exchange = _Exchange(decision.site)
                await self._forward(scope, receive, send, exchange, decision, model, pin, body, started)
                metrics.request(model, exchange.site, exchange.outcome or "client_closed")
            case Shed(retry_after_s=hint):
                metrics.shed(model)
                metrics.request(model, NO_SITE, "shed")
                await _send_error(send, 429, f"every site serving {model!r} is saturated; retry later",
                                  type_="rate_limit_exceeded", code="model_saturated",
                                  retry_after=retry_after_seconds(hint, self.rng))
            case Unavailable(retry_after_s=hint, cause=cause):
                metrics.unavailable_answer(model)
                metrics.request(model, NO_SITE, "unavailable")
                await _send_error(send, 503, self._unavailable_message(model, cause),
                                  type_="service_unavailable",
                                  code="no_routing_data" if cause == "no_operator_data" else "model_unavailable",
                                  retry_after=retry_after_seconds(hint, self.rng))
            case UnknownModel():
                metrics.request(OTHER_MODEL, NO_SITE, "unknown_model")
                await _send_error(send, 404, f"The model `{_shown(model)}` does not exist",
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

    async def _forward(self, scope: Scope, receive: Receive, send: Send, exchange: _Exchange,
                       forward: Forward, model: str, pin: str | None, body: bytes, started: float) -> None:
        # The watcher cancels the exchange the moment the client goes away (receive() reports
        # http.disconnect), whatever it is waiting on: connect, headers or the next chunk.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope, exchange.watching)
            try:
                await self._attempts(scope, send, exchange, forward, model, pin, body, started)
            except ClientDisconnected:
                exchange.outcome = "ok" if exchange.stream_done else "client_closed"
            exchange.watching.cancel()
        if exchange.outcome is None:
            exchange.outcome = "ok" if exchange.stream_done else "client_closed"
        if exchange.outcome == "client_closed":
            logger.debug("client left %s for model %r (site %s)", scope["path"], model, exchange.site)

    async def _attempts(self, scope: Scope, send: Send, exchange: _Exchange, forward: Forward,
                        model: str, pin: str | None, body: bytes, started: float) -> None:
        retried = False
        while True:
            exchange.site = forward.site
            target = self._target(forward, scope["path"], scope["query_string"])
            try:
                await self._exchange(send, exchange, target, scope["headers"], body, started)
                return
            except UpstreamError as exc:
                retry_after_s = self.limits.upstream_retry_after_s
                if exc.retryable and not retried:
                    retried = True
                    self.metrics.retry(exc.reason)
                    nxt = self.router.decide(model, pinned_site=pin,
                                             exclude=frozenset({(forward.site, forward.provider)}))
                    if isinstance(nxt, Forward):
                        logger.warning("upstream %s/%s failed before answering (%s: %s); retrying on %s/%s",
                                       forward.site, forward.provider, exc.reason, exc, nxt.site, nxt.provider)
                        forward = nxt
                        continue
                    if isinstance(nxt, (Shed, Unavailable)):
                        retry_after_s = nxt.retry_after_s
                await self._upstream_failed(send, exchange, forward.site, forward.provider, exc, retry_after_s)
                return

    def _target(self, forward: Forward, path: str, query: bytes) -> UpstreamTarget:
        """upstream_target, cached: the same provider config object (or ingress) and path give the
        same target. Keyed by identity: a reload brings new LocalProvider objects, so new keys."""
        key = (id(forward.local), forward.ingress_url, forward.site, forward.provider, path, query)
        hit = self._targets.get(key)
        if hit is not None and hit[0] is forward.local:
            return hit[1]
        target = upstream_target(forward, path, query)
        if len(self._targets) >= _TARGET_CACHE_SIZE:
            self._targets.clear()
        self._targets[key] = (forward.local, target)
        return target

    async def _exchange(self, send: Send, exchange: _Exchange, target: UpstreamTarget,
                        client_headers: list[tuple[bytes, bytes]], body: bytes, started: float) -> None:
        """One upstream attempt, relayed to the client as it arrives.

        One cancel scope bounds every phase, its deadline moved as the exchange advances:
        ``connect_s`` until a connection is ready, then the target's timeout until the first
        body byte, then ``stream_idle_s`` after each chunk relayed. Raises a retryable
        UpstreamError only while nothing was sent to the client.

        The head is held until the first body bytes (or the end of an empty body), so a
        failure before the first byte still gets a clean error. The body goes on in the pieces
        UpstreamBody.relay gathers (whatever has arrived, one send each); the last piece ends
        the response (one write for a small answer). A failure
        after the first byte cuts the client's response: the app returns without finishing it,
        and the server closes the connection (a truncated body, never a hang)."""
        limits = self.limits
        timeout_s = target.timeout_s
        if timeout_s is None:
            timeout_s = limits.remote_timeout_s if target.remote else limits.upstream_timeout_s
        sent_at = trio.current_time()
        bound = trio.CancelScope(deadline=sent_at + limits.connect_s)
        phase = "connect"

        def on_connected() -> None:
            nonlocal phase
            if bound.cancel_called:
                # The connect bound fired before this task saw it (a loaded event loop): moving
                # the deadline cannot undo that, and the exchange ends at its next checkpoint.
                # It is a connect timeout (retried), not a header timeout (docs/reliability.md).
                return
            phase = "headers"
            bound.deadline = trio.current_time() + timeout_s

        transport = self.ingress_transport if target.remote else self.transport
        upstream: UpstreamBody | None = None
        head_sent = finished = False
        status = 0
        try:
            with bound:
                response = await open_upstream(transport, target, request_headers(client_headers, target.headers),
                                               body, on_connected)
                phase = "first_byte"
                metrics = self.metrics
                metrics.observe_upstream_latency(target.site, trio.current_time() - sent_at)
                upstream = UpstreamBody(response, target)
                status = response.status_code
                relayed, _ = response_headers(response.headers.raw)
                # Which site and provider answered, `<site>/<provider>`: for clients' logs and the
                # demo; never read by routing. A remote site's gateway set it first (it picked its
                # own provider); a local provider's answer cannot name itself.
                if not (target.remote and any(name.lower() == SERVED_BY for name, _ in relayed)):
                    relayed = [(name, value) for name, value in relayed if name.lower() != SERVED_BY]
                    relayed.append((SERVED_BY, f"{target.site}/{target.provider}".encode()))
                head = {"type": "http.response.start", "status": status, "headers": relayed}
                idle_s = limits.stream_idle_s

                async def deliver(data: bytes, last: bool) -> None:
                    nonlocal phase, head_sent, finished
                    if not head_sent:
                        phase = "idle"
                        await send(head)
                        head_sent = True
                        metrics.observe_first_byte(target.site, trio.current_time() - started)
                    if last or data.endswith(SSE_DONE):
                        # The client has everything once this goes out (the last byte, or the
                        # OpenAI stream terminator); its hanging up next is not a lost answer.
                        exchange.watching.cancel()
                        exchange.stream_done = True
                    await send({"type": "http.response.body", "body": data, "more_body": not last})
                    finished = last
                    bound.deadline = trio.current_time() + idle_s

                await upstream.relay(deliver)
        except UpstreamError as exc:
            if not head_sent:
                raise
            exchange.outcome = "stream_error"
            logger.warning("upstream %s/%s broke mid-stream (%s); cutting the client's response",
                           target.site, target.provider, exc)
            return
        finally:
            if upstream is not None:
                # Shielded: a client that left must still free the backend's sequence.
                with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLOSE_S):
                    await upstream.aclose()
        if finished:
            exchange.outcome = "ok" if status < 400 else "upstream_4xx"
            return
        # The bound fired.
        if phase == "connect":
            raise UpstreamError(f"no connection to {target.url} within {limits.connect_s} s",
                                reason="connect_timeout", retryable=True)
        if phase == "headers":
            raise UpstreamError(f"no response headers from {target.url} within {timeout_s} s",
                                reason="header_timeout", retryable=False)
        if phase == "first_byte":
            raise UpstreamError(f"no response body from {target.url} within {timeout_s} s",
                                reason="first_byte_timeout", retryable=False)
        exchange.outcome = "stream_error"
        logger.warning("upstream %s/%s sent nothing for %s s; cutting the client's response",
                       target.site, target.provider, limits.stream_idle_s)

    async def _upstream_failed(self, send: Send, exchange: _Exchange, site: str, provider: str,
                               exc: UpstreamError, retry_after_s: float) -> None:
        """No upstream answer to relay: 504 after a timeout, else 502; both with Retry-After."""
        timeout = exc.reason.endswith("timeout")
        exchange.outcome = "upstream_timeout" if timeout else "upstream_error"
        logger.warning("answering %d: upstream %s/%s failed (%s: %s)", 504 if timeout else 502,
                       site, provider, exc.reason, exc)
        if timeout:
            await _send_error(send, 504, "the model server did not answer in time", type_="upstream_error",
                              code="upstream_timeout", retry_after=retry_after_seconds(retry_after_s, self.rng))
        else:
            await _send_error(send, 502, "no model server could take the request", type_="upstream_error",
                              code="upstream_unavailable",
                              retry_after=retry_after_seconds(retry_after_s, self.rng))


def make_front_app(router: Router, transport: httpx.AsyncBaseTransport, registry: CollectorRegistry, *,
                   rng: random.Random, limits: FrontLimits = FrontLimits(),
                   ingress_transport: httpx.AsyncBaseTransport | None = None,
                   created_unix: int | None = None) -> FrontApp:
    """The OpenAI front as an ASGI app (serve it with gridd.http.serve.serve_asgi).

    router: routing decisions (the gateway store). transport: the pooled upstream transport
    for this site's providers, from forward.make_upstream_transport (the caller closes it).
    registry: the front registers its collector here and serves it on GET /metrics. rng:
    Retry-After jitter. limits: bounds. ingress_transport: for other sites' ingress (e.g. with
    the gateway's mTLS identity and the grid CA); defaults to ``transport``. created_unix:
    ``created`` of every /v1/models entry (default: now).
    """
    for given in (transport, ingress_transport):
        if given is not None and not isinstance(given, httpx.AsyncBaseTransport):
            raise TypeError(f"make_front_app takes an httpx transport (forward.make_upstream_transport()), "
                            f"not {type(given).__name__}")
    return FrontApp(router, transport, registry, rng=rng, limits=limits, ingress_transport=ingress_transport,
                    created_unix=int(time.time()) if created_unix is None else created_unix)
