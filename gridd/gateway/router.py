"""What the OpenAI front asks of the gateway's routing: one decision per request.

The request path reads one immutable ordered snapshot per model (built off the request
path by the scorer) and never reads raw signals. ``decide`` is synchronous and cheap.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from gridd.wire import LocalProvider

PIN_HEADER = "x-gridd-site"
"""A request forwarded to another site's ingress carries this header naming that site; the
receiving gateway serves it locally and never re-routes it (no loops)."""


class Forward(msgspec.Struct, frozen=True):
    """Send the request to one provider of this site, or to another site's ingress."""

    site: str
    provider: str
    model: str
    local: LocalProvider | None = None
    """Set for this site's providers: endpoint, auth and headers from our own operator."""
    ingress_url: str | None = None
    """Set for another site: its gateways' base URL; the request carries PIN_HEADER."""


class Shed(msgspec.Struct, frozen=True):
    """Every healthy site serving the model has been saturated with work waiting: 429."""

    retry_after_s: float


class Unavailable(msgspec.Struct, frozen=True):
    """The model exists but every candidate is excluded (not ready, zero endpoints): 503."""

    retry_after_s: float


class UnknownModel(msgspec.Struct, frozen=True):
    """No site serves the model: 404."""


Decision = Forward | Shed | Unavailable | UnknownModel


class Router(Protocol):
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
