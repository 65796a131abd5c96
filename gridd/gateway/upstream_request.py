"""One OpenAI request to its upstream: where it goes, which headers pass, and opening it.

Upstream is either one of this site's providers (its OpenAI base ``.../v1`` and the
credentials our own operator sent) or another site's gateways (its ingress URL, with
PIN_HEADER naming that site so it serves the request locally and never re-routes it).

The pure half builds targets and filters headers. ``open_upstream`` sends the request over
the injected httpx transport (upstream_transport) and maps its failures into UpstreamError
(upstream_errors); the body is relayed by upstream_body.

No timeouts live here (STYLE 3): requests carry no httpx timeout and the front bounds every
phase with trio cancel scopes. ``open_upstream`` reports the moment the connection is
established (``on_connected``), so the caller can move one deadline from the connect bound to
the time-to-headers bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gridd.core.decisions import Forward
from gridd.gateway.pin import PIN_HEADER
from gridd.gateway.upstream_errors import answered_error_status, failed_before_answer

__all__ = [
    "HOP_BY_HOP",
    "UpstreamTarget",
    "open_upstream",
    "request_headers",
    "response_headers",
    "upstream_target",
]

_PIN = PIN_HEADER.encode("ascii")

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded in either direction.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})

# Client request headers the gateway drops on top of the hop-by-hop ones:
# - host, content-length: httpx writes them for the upstream request;
# - authorization, cookie: the client's credentials are for this gateway; providers get the
#   provider credentials our operator configured, remote sites their own;
# - expect: 100-continue is answered by our HTTP server, the body is already read;
# - PIN_HEADER: set by this gateway only, for a remote site.
_DROPPED_REQUEST = HOP_BY_HOP | {
    b"host", b"content-length", b"authorization", b"cookie", b"expect", _PIN,
}
# Response headers rebuilt by our server: framing (transfer-encoding is hop-by-hop already).
_DROPPED_RESPONSE = HOP_BY_HOP


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where one attempt goes and what it adds to the client's headers."""

    site: str
    provider: str
    url: httpx.URL
    headers: tuple[tuple[bytes, bytes], ...] = field(repr=False)
    """Target headers (auth, provider custom headers, PIN_HEADER); they override client ones.
    They carry the provider's credentials, so they stay out of repr() and logs."""
    timeout_s: float | None
    """The provider's own bound on time to response headers; None for a remote site."""
    remote: bool


def upstream_target(forward: Forward, path: str, query: bytes = b"") -> UpstreamTarget:
    """The URL and headers for ``forward`` of a request to ``path`` (``/v1/...``).

    Local provider: its OpenAI base (``.../v1``) plus the path after ``/v1``, with its auth:
    ``bearer`` sends ``Authorization: Bearer <api_key>``; ``header`` arrives from the operator
    already placed in ``headers`` under the configured name; custom headers are sent verbatim.
    Remote site: its ingress URL plus the whole path, with ``PIN_HEADER: <site>``.
    """
    suffix = path + ("?" + query.decode("latin-1") if query else "")
    local = forward.local
    if local is not None:
        base = local.endpoint_url.rstrip("/")
        rest = suffix[3:] if suffix.startswith("/v1") else suffix
        headers: list[tuple[bytes, bytes]] = [
            (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in local.headers.items()
        ]
        if local.auth_scheme == "bearer" and local.api_key:
            headers = [h for h in headers if h[0] != b"authorization"]
            headers.append((b"authorization", b"Bearer " + local.api_key.encode("latin-1")))
        return UpstreamTarget(forward.site, forward.provider, httpx.URL(base + rest), tuple(headers),
                              local.timeout_s, remote=False)
    if forward.ingress_url is None:
        raise ValueError(f"Forward to {forward.site}/{forward.provider} has neither a provider nor an "
                         "ingress")
    return UpstreamTarget(forward.site, forward.provider, httpx.URL(forward.ingress_url.rstrip("/") + suffix),
                          ((_PIN, forward.site.encode("latin-1")),), None, remote=True)


def _connection_listed(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    listed: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            listed.update(token.strip().lower() for token in value.split(b","))
    return frozenset(listed)


def request_headers(client: list[tuple[bytes, bytes]],
                    target: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """Client headers to send upstream, then the target's (which win on a shared name).

    Everything the client sent passes (content-type, accept, accept-encoding, user-agent,
    x-request-id, llm-d's x-llm-d-inference-fairness-id, ...) except hop-by-hop headers,
    headers the client's Connection header lists, and _DROPPED_REQUEST. Nothing is added
    but the target's headers (an httpx transport sets only Host and Content-Length), so the
    upstream is asked for exactly the encodings the client accepts and its bytes can be
    relayed unchanged.
    """
    listed = _connection_listed(client)
    target_names = {name for name, _ in target}
    out: list[tuple[bytes, bytes]] = []
    for name, value in client:
        lowered = name.lower()
        if lowered in _DROPPED_REQUEST or lowered in target_names or (listed and lowered in listed):
            continue
        out.append((lowered, value))
    out.extend(target)
    return out


def response_headers(upstream: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], int]:
    """Upstream response headers to relay (all but hop-by-hop and Connection-listed ones) and
    the body length they declare (-1 when none or unreadable).

    Content-Length and Content-Encoding pass: the body is relayed byte for byte."""
    listed = _connection_listed(upstream)
    out = []
    length = -1
    for name, value in upstream:
        lowered = name.lower()
        if lowered in _DROPPED_RESPONSE or (listed and lowered in listed):
            continue
        if lowered == b"content-length":
            length = int(value) if value.isdigit() else -1
        out.append((lowered, value))
    return out, length


_CONNECTED_EVENT = "http11.send_request_headers.started"


async def open_upstream(transport: httpx.AsyncBaseTransport, target: UpstreamTarget,
                        headers: list[tuple[bytes, bytes]], body: bytes,
                        on_connected: Callable[[], None]) -> httpx.Response:
    """POST ``body`` to ``target`` and return the open response once its headers arrived.

    ``on_connected`` runs when a connection (new or pooled) is ready and the request starts
    going out. The response body is not read: wrap it in UpstreamBody and close it. A 5xx
    answer is closed here and raised as a retryable UpstreamError (nothing was relayed).
    """
    connected = False

    async def trace(name: str, info: Any) -> None:
        nonlocal connected
        if name == _CONNECTED_EVENT and not connected:
            connected = True
            on_connected()

    # No "timeout" extension: httpcore then applies none (the caller's scopes bound it).
    request = httpx.Request("POST", target.url, headers=headers, content=body, extensions={"trace": trace})
    try:
        response = await transport.handle_async_request(request)
    except (httpx.TransportError, httpx.InvalidURL) as exc:
        raise failed_before_answer(exc, target.url, connected=connected) from exc
    if response.status_code >= 500:
        await response.aclose()
        raise answered_error_status(target.url, response.status_code)
    return response
