"""What the OpenAI front asks of the gateway's routing: one decision per request.

The request path reads one immutable ordered snapshot per model (built off the request
path by the scorer) and never reads raw signals. ``decide`` is synchronous and cheap.
"""

from __future__ import annotations

from typing import Protocol

from gridd.core.decisions import Decision, Forward, Shed, Unavailable, UnknownModel
from gridd.gateway.pin import PIN_HEADER

__all__ = ["PIN_HEADER", "Decision", "Forward", "Router", "Shed", "Unavailable", "UnknownModel"]


class Router(Protocol):
    site: str
    """This gateway's site; a pinned request naming another site is misdirected (421)."""

    def decide(self, model: str, *, pinned_site: str | None = None,
               exclude: frozenset[tuple[str, str]] = frozenset()) -> Decision:
        """Pick a site for one request. ``pinned_site``: the request came from another site's
        gateway with PIN_HEADER; only this site's own providers may serve it. ``exclude``:
        (site, provider) pairs already tried for this request (one bounded retry)."""
        ...

    def models(self) -> list[str]:
        """Every model some site serves, for GET /v1/models."""
        ...

    def ready(self) -> bool:
        """Serving and holding a fresh snapshot (GET /readyz)."""
        ...

    def not_ready_reason(self) -> str | None:
        """Why ``ready()`` is false, for people (the /readyz body, gridctl status)."""
        ...

    async def first_routing_data(self) -> None:
        """Return once the gateway has held routing data at least once since it started
        (at once if it has). The caller bounds the wait."""
        ...
