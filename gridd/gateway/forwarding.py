"""Forwarding one routed request: the front's half that talks to upstreams.

The upstream answer streams back chunk by chunk; a second task waits for the client to go
away and cancels the whole exchange, which closes the upstream connection so the backend
frees the sequence at once. A retry on the next candidate happens at most once, and only
while nothing of the answer reached the client.

Bounds (STYLE 3; docs/front.md), all trio cancel scopes, none in the client: ``connect_s``
until a connection is ready; from there to the first body byte the provider's ``timeout_s``
(or the front's defaults); between body chunks ``stream_idle_s``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import trio

from gridd.gateway.front_errors import retry_after_seconds, send_error
from gridd.gateway.front_limits import FrontLimits
from gridd.gateway.front_metrics import FrontMetrics
from gridd.gateway.router import Forward, Router, Shed, Unavailable
from gridd.gateway.upstream_errors import UpstreamError, answered_error_status
from gridd.gateway.upstream_request import (
    Upstream,
    UpstreamAnswer,
    UpstreamTarget,
    response_headers,
    upstream_target,
)
from gridd.http.asgi import ClientDisconnected, Receive, Scope, Send

__all__ = ["SERVED_BY", "SSE_DONE", "Exchange", "Forwarder"]

logger = logging.getLogger("gridd.gateway.front")

SERVED_BY = b"x-gridd-served-by"
SSE_DONE = b"data: [DONE]\n\n"
"""The last event of an OpenAI-compatible stream."""
_TARGET_CACHE_SIZE = 1024


async def _cancel_on_disconnect(receive: Receive, exchange_scope: trio.CancelScope,
                                 watching: trio.CancelScope) -> None:
    with watching:
        while (await receive())["type"] != "http.disconnect":
            pass
        exchange_scope.cancel()


class Exchange:
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


class Forwarder:
    """Sends a routed request upstream and relays the answer (FrontApp's forwarding half).

    transport: this site's providers; ingress_transport: other sites' ingress (both Upstream:
    upstream_request). The router is asked again (excluding the failed candidate) for the one
    retry."""

    def __init__(self, router: Router, transport: Upstream,
                 ingress_transport: Upstream, metrics: FrontMetrics, *,
                 rng: random.Random, limits: FrontLimits) -> None:
        self.router = router
        self.transport = transport
        self.ingress_transport = ingress_transport
        self.metrics = metrics
        self.rng = rng
        self.limits = limits
        self._targets: dict[tuple[Any, ...], tuple[Any, UpstreamTarget]] = {}

    async def forward(self, scope: Scope, receive: Receive, send: Send, exchange: Exchange,
                      forward: Forward, model: str, pin: str | None, body: bytes, started: float) -> None:
        """Forward one request (``body`` already read) and relay the answer; ``exchange`` says
        how it ended. ``started``: the request's arrival (time to first byte)."""
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

    async def _attempts(self, scope: Scope, send: Send, exchange: Exchange, forward: Forward,
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
                                       forward.site, forward.provider, exc.reason, exc, nxt.site,
                                       nxt.provider)
                        forward = nxt
                        continue
                    if isinstance(nxt, (Shed, Unavailable)):
                        retry_after_s = nxt.retry_after_s
                await self._upstream_failed(send, exchange, forward.site, forward.provider, exc,
                                            retry_after_s)
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

    async def _exchange(self, send: Send, exchange: Exchange, target: UpstreamTarget,
                        client_headers: list[tuple[bytes, bytes]], body: bytes, started: float) -> None:
        """One upstream attempt, relayed to the client as it arrives.

        One cancel scope bounds every phase, its deadline moved as the exchange advances:
        ``connect_s`` until a connection is ready, then the target's timeout until the first
        body byte, then ``stream_idle_s`` after each chunk relayed. Raises a retryable
        UpstreamError only while nothing was sent to the client.

        The head is held until the first body bytes (or the end of an empty body), so a
        failure before the first byte still gets a clean error. The body goes on in the pieces
        the answer's relay hands on (whatever one read brought, one send each); the last piece ends
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
        upstream: UpstreamAnswer | None = None
        head_sent = finished = False
        status = 0
        try:
            with bound:
                upstream = await transport.open(target, client_headers, body, on_connected)
                status = upstream.status
                if status >= 500:
                    # Nothing of it is relayed (closed unread below): the next candidate may serve.
                    raise answered_error_status(target.url, status)
                phase = "first_byte"
                metrics = self.metrics
                metrics.observe_upstream_latency(target.site, trio.current_time() - sent_at)
                relayed = response_headers(upstream.headers)
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
                # A client that left must still free the backend's sequence: an answer's aclose
                # is never cut short by this task's cancellation (UpstreamAnswer).
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

    async def _upstream_failed(self, send: Send, exchange: Exchange, site: str, provider: str,
                               exc: UpstreamError, retry_after_s: float) -> None:
        """No upstream answer to relay: 504 after a timeout, else 502; both with Retry-After."""
        timeout = exc.reason.endswith("timeout")
        exchange.outcome = "upstream_timeout" if timeout else "upstream_error"
        logger.warning("answering %d: upstream %s/%s failed (%s: %s)", 504 if timeout else 502,
                       site, provider, exc.reason, exc)
        if timeout:
            await send_error(send, 504, "the model server did not answer in time", type_="upstream_error",
                             code="upstream_timeout",
                             retry_after=retry_after_seconds(retry_after_s, self.rng))
        else:
            await send_error(send, 502, "no model server could take the request", type_="upstream_error",
                             code="upstream_unavailable",
                             retry_after=retry_after_seconds(retry_after_s, self.rng))
