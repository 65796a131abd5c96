"""The front's bounds (docs/front.md, "Timeouts"): all trio cancel scopes, none inside httpx."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FrontLimits"]


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
