"""A routing decision for one request: what the OpenAI front does with it."""

from __future__ import annotations

import msgspec

from gridd.core.serving import LocalProvider


class Forward(msgspec.Struct, frozen=True):
    """Send the request to one provider of this site, or to another site's ingress."""

    site: str
    provider: str
    model: str
    local: LocalProvider | None = None
    """Set for this site's providers: endpoint, auth and headers from our own operator."""
    ingress_url: str | None = None
    """Set for another site: its gateways' base URL; the request carries the gateway's pin
    header naming that site."""


class Shed(msgspec.Struct, frozen=True):
    """Every healthy site serving the model has been saturated with work waiting: 429."""

    retry_after_s: float


class Unavailable(msgspec.Struct, frozen=True):
    """No site can serve the model now: 503 with Retry-After.

    cause: ``excluded`` (every candidate excluded: not ready, zero endpoints, no route),
    ``silent`` (every candidate went silent: no reading for 2 x the signal TTL),
    ``strategy`` (every healthy candidate is over a bound of the model's strategy), or
    ``no_operator_data`` (the gateway has no routing data from its operator: no poll has
    succeeded, or none within the signal TTL; it cannot tell which models exist).
    """

    retry_after_s: float
    cause: str = "excluded"


class UnknownModel(msgspec.Struct, frozen=True):
    """No site serves the model: 404."""


Decision = Forward | Shed | Unavailable | UnknownModel
