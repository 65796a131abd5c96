"""One OpenAI request to its upstream: where it goes, which headers pass, and what opening it
gives back.

Upstream is either one of this site's providers (its OpenAI base ``.../v1`` and the
credentials our own operator sent) or another site's gateways (its ingress URL, with
PIN_HEADER naming that site so it serves the request locally and never re-routes it).

This module is the pure half: targets (with their request bytes built once) and header
rules, and the ``Upstream`` interface the front forwards through. Two implementations:
upstream_client.UpstreamClient (the daemon's and the benchmarks') and
upstream_httpx.HttpxUpstream (any httpx transport; tests inject mock and ASGI transports).

No timeouts live here (STYLE 3): the front bounds every phase with trio cancel scopes.
``Upstream.open`` reports the moment a connection is ready (``on_connected``), so the caller
can move one deadline from the connect bound to the time-to-headers bound.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import httpx

from gridd.core.decisions import Forward
from gridd.gateway.pin import PIN_HEADER

__all__ = [
    "HOP_BY_HOP",
    "Deliver",
    "Upstream",
    "UpstreamAnswer",
    "UpstreamTarget",
    "request_header_block",
    "request_headers",
    "response_headers",
    "upstream_target",
]

Deliver = Callable[[bytes, bool], Awaitable[None]]
"""``deliver(data, last)``: the relay's hand-off of body bytes to the client."""


class UpstreamAnswer(Protocol):
    """An upstream response whose head is in: its status and header fields (raw), its body
    relayed with ``relay(deliver)``; closed with ``aclose`` (an unfinished one closes its
    connection, so the upstream sees EOF). ``aclose`` finishes even in a cancelled task: where
    closing does IO it is shielded and bounded (1 s), so a client that left frees the backend."""

    status: int
    headers: list[tuple[bytes, bytes]]

    async def relay(self, deliver: Deliver) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Upstream(Protocol):
    """Where the front sends requests: ``open`` POSTs ``body`` to ``target`` with the client's
    headers (filtered here: request_headers) and returns once the response head is in. Every
    failure before that is an UpstreamError (upstream_errors)."""

    async def open(self, target: UpstreamTarget, client_headers: list[tuple[bytes, bytes]], body: bytes,
                   on_connected: Callable[[], None]) -> UpstreamAnswer: ...

    async def aclose(self) -> None: ...


_PIN = PIN_HEADER.encode("ascii")

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded in either direction.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})

# Client request headers the gateway drops on top of the hop-by-hop ones:
# - host, content-length: the forwarding client (or an httpx transport) writes its own;
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
    origin: tuple[str, str, int] = field(init=False, repr=False, compare=False)
    """(scheme, host, port) to connect to: the pool's key."""
    request_head: bytes | None = field(init=False, repr=False, compare=False)
    """The request line and Host field, as upstream_client sends them (httpx's order and
    spelling: Host first); None when a target header holds CR, LF or NUL (never sent)."""
    header_names: frozenset[bytes] = field(init=False, repr=False, compare=False)
    header_block: bytes = field(init=False, repr=False, compare=False)
    """The target headers as field lines, sent after the client's."""

    def __post_init__(self) -> None:
        url = self.url
        scheme = url.scheme
        port = url.port or {"http": 80, "https": 443}.get(scheme, 0)
        setter = object.__setattr__  # frozen: the derived fields are set once, here
        setter(self, "origin", (scheme, url.raw_host.decode("ascii"), port))
        block = b"".join(name + b": " + value + b"\r\n" for name, value in self.headers)
        head = b"POST " + url.raw_path + b" HTTP/1.1\r\nHost: " + url.netloc + b"\r\n"
        clean = b"\0" not in block and block.count(b"\r") == block.count(b"\n") == len(self.headers)
        setter(self, "request_head", head if clean else None)
        setter(self, "header_names", frozenset(name for name, _ in self.headers))
        setter(self, "header_block", block)


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


def _forwarded(client: list[tuple[bytes, bytes]],
               target_names: frozenset[bytes]) -> Iterator[tuple[bytes, bytes]]:
    """The client's headers that pass (request_headers), names lowercased."""
    listed = _connection_listed(client)
    for name, value in client:
        lowered = name.lower()
        if lowered in _DROPPED_REQUEST or lowered in target_names or (listed and lowered in listed):
            continue
        yield lowered, value


def request_headers(client: list[tuple[bytes, bytes]],
                    target: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """Client headers to send upstream, then the target's (which win on a shared name).

    Everything the client sent passes (content-type, accept, accept-encoding, user-agent,
    x-request-id, llm-d's x-llm-d-inference-fairness-id, ...) except hop-by-hop headers,
    headers the client's Connection header lists, and _DROPPED_REQUEST. Nothing is added
    but the target's headers (the forwarding client, like an httpx transport, adds only Host and
    Content-Length), so the
    upstream is asked for exactly the encodings the client accepts and its bytes can be
    relayed unchanged.
    """
    out = list(_forwarded(client, frozenset(name for name, _ in target)))
    out.extend(target)
    return out


def request_header_block(client: list[tuple[bytes, bytes]], target_names: frozenset[bytes]) -> bytes | None:
    """The client headers that pass (request_headers) as field lines, or None when a value
    holds CR, LF or NUL (it would split the request; our server never lets one in)."""
    lines = [name + b": " + value + b"\r\n" for name, value in _forwarded(client, target_names)]
    block = b"".join(lines)
    if block.count(b"\n") != len(lines) or block.count(b"\r") != len(lines) or b"\0" in block:
        return None
    return block


def response_headers(upstream: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers to relay: all but hop-by-hop and Connection-listed ones.

    Content-Length and Content-Encoding pass: the body is relayed byte for byte."""
    listed = _connection_listed(upstream)
    out = []
    for name, value in upstream:
        lowered = name.lower()
        if lowered in _DROPPED_RESPONSE or (listed and lowered in listed):
            continue
        out.append((lowered, value))
    return out
