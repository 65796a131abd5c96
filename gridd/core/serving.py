"""Where a gateway forwards: its own site's providers and the other sites' ingresses.

The operator sends these to its own site's gateways (gridd.wire.ServingConfig carries them);
the gateway's router turns a pick into a forward with them (gridd.core.decisions.Forward).
They are wire values, so the evolution rules of docs/wire.md bind them.
"""

from __future__ import annotations

from typing import Final, Protocol

import msgspec

__all__ = ["NO_ROUTES", "LocalProvider", "ServingRoutes", "SiteIngress"]


class LocalProvider(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a gateway forwards to one of its own site's providers. Carries a secret.

    No readiness verdict travels here (spec: "The serving config carries the same
    verdict for local providers as admission: none").
    """

    provider: str
    model: str
    endpoint_url: str
    auth_scheme: str = "none"
    api_key: str | None = None
    headers: dict[str, str] = {}
    timeout_s: float | None = None

    def __repr__(self) -> str:
        # Keep api_key and header values out of logs and tracebacks.
        key = None if self.api_key is None else "***REDACTED***"
        return (
            f"LocalProvider(provider={self.provider!r}, model={self.model!r}, "
            f"endpoint_url={self.endpoint_url!r}, auth_scheme={self.auth_scheme!r}, "
            f"api_key={key!r}, headers={sorted(self.headers)!r}, timeout_s={self.timeout_s!r})"
        )


class SiteIngress(msgspec.Struct, frozen=True):
    """Where another site's gateways take requests routed to that site."""

    site: str
    url: str


class ServingRoutes(Protocol):
    """What the router forwards by (gridd.wire.ServingConfig is one)."""

    @property
    def providers(self) -> tuple[LocalProvider, ...]: ...

    @property
    def ingresses(self) -> tuple[SiteIngress, ...]: ...


class _NoRoutes(msgspec.Struct, frozen=True):
    providers: tuple[LocalProvider, ...] = ()
    ingresses: tuple[SiteIngress, ...] = ()


NO_ROUTES: Final[ServingRoutes] = _NoRoutes()
"""A gateway's routes before its operator sent any: nothing is routable."""
