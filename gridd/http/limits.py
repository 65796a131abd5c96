"""The HTTP server's bounds (both backends; docs/http-serving.md, "Timeouts and limits") and the
checks of a request head they need.

Every bound is a policy of the server, per connection, per listener or per server; none is a
timeout on serve_asgi itself (STYLE 3).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFAULT_BODY_DEADLINE_S",
    "DEFAULT_BODY_IDLE_S",
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HEADER_BYTES",
    "ServerLimits",
    "declared_length",
    "has_both_framings",
    "head_size",
]

# How long a keep-alive connection may sit without a complete request head before the server
# closes it. Same as hypercorn's default; clients' pools (httpx: 5 s) expire at about the same age.
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_BODY_IDLE_S = 10.0
"""A request body that stalls this long between reads is abandoned (408)."""
DEFAULT_BODY_DEADLINE_S = 30.0
"""A request body not complete this long after its head arrived is abandoned (408), however
steadily it trickles: the idle bound alone restarts on every byte."""
DEFAULT_MAX_CONNECTIONS = 1024
"""Open connections per listener. Past it, a new connection evicts the longest-waiting one
that is only waiting on its client (for a request head or body bytes); when every one is
busy in the app, the new one gets 503 and is closed."""
DEFAULT_MAX_BUFFERED_BYTES = 16 * 1024 * 1024
"""Bytes of request bodies still arriving, across every connection of one server: a body's
bytes count from their arrival until the body is complete (or its request ends). A complete
body is the app's, bounded by the app's own work (the front: the upstream's time); an
incomplete one only by its client. A chunk that would pass the cap ends the request whose
body has been arriving longest (503): a slow uploader loses its place, not a new request."""
# Largest request body handed to the app. OpenAI-style chat requests with long contexts stay well
# under this; anything bigger is refused with 413.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Largest request head (request line + headers), h11's own default. Over it: 431.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024


class ServerLimits:
    """The bounds of one serve_asgi call (its keyword arguments, see there)."""

    __slots__ = ("keep_alive_s", "max_body_bytes", "max_header_bytes", "body_idle_s", "body_deadline_s",
                 "max_connections", "max_buffered_bytes")

    def __init__(self, keep_alive_s: float, max_body_bytes: int, max_header_bytes: int,
                 body_idle_s: float = DEFAULT_BODY_IDLE_S, body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES) -> None:
        self.keep_alive_s = keep_alive_s
        self.body_idle_s = body_idle_s
        self.body_deadline_s = body_deadline_s
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes


def head_size(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """Bytes of a request head as sent (request line, "name: value\\r\\n" lines, blank line).

    h11 only bounds an *incomplete* head, so a head that arrives whole in one read would pass its
    check at any size up to the read size; this is the exact bound applied afterwards."""
    size = len(method) + len(target) + len(b"  HTTP/1.1\r\n\r\n")
    for name, value in headers:
        size += len(name) + len(value) + 4
    return size


def has_both_framings(headers: Any) -> bool:
    """Content-Length and Transfer-Encoding together: RFC 9112 6.1 lets a server reject the
    request and requires it to close the connection either way (a request-smuggling shape)."""
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def declared_length(headers: Any) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # h11 has already rejected non-digit or conflicting values
    return None
