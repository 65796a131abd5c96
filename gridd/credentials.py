"""Which credentials a request to a URL may carry (docs/security.md).

A secret is bound to the origin it was configured for: a metrics or probe URL gets its own
``auth`` block, else the provider's ``settings.auth`` only when the URL has the origin of
``settings.endpoint``, else nothing.
"""

from __future__ import annotations

import httpx

from gridd.config_schema import AuthConfig, ProviderConfig


def auth_headers(auth: AuthConfig) -> dict[str, str]:
    """The request headers an auth block sends: its custom headers, then the key under the
    scheme's header (``bearer``: ``Authorization: Bearer <key>``)."""
    headers = dict(auth.custom_headers)
    if auth.scheme == "bearer" and auth.api_key:
        headers["authorization"] = f"Bearer {auth.api_key}"
    elif auth.scheme == "header" and auth.api_key:
        headers[auth.header_name] = auth.api_key
    return headers


def url_origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in: what a secret is bound
    to (docs/security.md)."""
    u = httpx.URL(url)
    return u.scheme, u.host, u.port if u.port is not None else _DEFAULT_PORTS.get(u.scheme)


_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def credentials_for(url: str, own: AuthConfig | None, provider: ProviderConfig) -> dict[str, str]:
    """Headers for a metrics or probe request to ``url``. A secret is bound to the origin it
    was configured for: the URL's own auth block if it has one; else the provider's
    ``settings.auth`` when ``url`` has the origin of ``settings.endpoint``; else nothing."""
    if own is not None:
        return auth_headers(own)
    if url_origin(url) != url_origin(provider.settings.endpoint):
        return {}
    return auth_headers(provider.settings.auth)
