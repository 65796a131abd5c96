"""Secrets bound to their origin (docs/security.md).

A secret is bound to the origin (scheme, host, port) it was configured for. A POST that
would send a secret to an origin it is not bound to in the running config (a changed
settings.endpoint, metrics.url or probe endpoint, a placeholder moved into another URL's
query) is refused unless the request itself carries the secret in full: a literal value
present in the body. A ``${VAR}`` placeholder is never "supplied": its value is the
daemon's, so it may only go where the running config already sends it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gridd.api.errors import ApiError
from gridd.api.redaction import names_only, split_url, url_secret_values
from gridd.config import placeholder_names

__all__ = ["Binding", "check_secret_origins", "secret_bindings"]

Binding = tuple[str, str, str]
"""("var", NAME, origin) or ("lit", value, origin)."""


def _origin_of(url: Any) -> str | None:
    parts = split_url(url) if isinstance(url, str) else None
    return parts.origin() if parts is not None else None


def _secret_value_bindings(value: Any, origin: str, where: str, out: dict[Binding, str]) -> None:
    if not isinstance(value, str) or not value:
        return
    for name in placeholder_names(value):
        out.setdefault(("var", name, origin), where)
    if not names_only(value):
        out.setdefault(("lit", value, origin), where)


def _auth_bindings(auth: Any, origin: str | None, where: str, out: dict[Binding, str]) -> None:
    if not isinstance(auth, dict) or origin is None:
        return
    _secret_value_bindings(auth.get("api_key"), origin, f"{where}.api_key", out)
    headers = auth.get("custom_headers")
    for name, value in (headers.items() if isinstance(headers, dict) else ()):
        _secret_value_bindings(value, origin, f"{where}.custom_headers.{name}", out)


def _url_bindings(url: Any, where: str, out: dict[Binding, str]) -> None:
    parts = split_url(url) if isinstance(url, str) else None
    if parts is None:
        return
    origin = parts.origin()
    for _, value in url_secret_values(parts):
        _secret_value_bindings(value, origin, where, out)
    # Any placeholder outside the host (path, query, userinfo) travels to that origin.
    for name in placeholder_names(url) - placeholder_names(parts.hostport):
        out.setdefault(("var", name, origin), where)


def secret_bindings(provider: Mapping[str, Any]) -> dict[Binding, str]:
    """Every (secret, origin) a provider, as written, sends, with the field it comes from.
    ``settings.auth`` goes to ``settings.endpoint``'s origin (and to probe and metrics URLs of
    that same origin, which binds nothing new); a URL's own ``auth`` block to that URL."""
    out: dict[Binding, str] = {}
    given = provider.get("settings")
    settings: dict[str, Any] = given if isinstance(given, dict) else {}
    endpoint = settings.get("endpoint")
    _url_bindings(endpoint, "settings.endpoint", out)
    _auth_bindings(settings.get("auth"), _origin_of(endpoint), "settings.auth", out)
    probes = settings.get("probes")
    for i, probe in enumerate(probes if isinstance(probes, list) else ()):
        if not isinstance(probe, dict):
            continue
        where = f"settings.probes[{i}]"
        _url_bindings(probe.get("endpoint"), f"{where}.endpoint", out)
        _auth_bindings(probe.get("auth"), _origin_of(probe.get("endpoint") or endpoint), f"{where}.auth",
                       out)
    metrics = provider.get("metrics")
    if isinstance(metrics, dict):
        _url_bindings(metrics.get("url"), "metrics.url", out)
        _auth_bindings(metrics.get("auth"), _origin_of(metrics.get("url")), "metrics.auth", out)
    return out


def _all_bindings(raw: Mapping[str, Any]) -> set[Binding]:
    found: set[Binding] = set()
    for provider in raw.get("providers") or []:
        if isinstance(provider, dict):
            found |= set(secret_bindings(provider))
    return found


def _body_strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return [text for item in items for text in _body_strings(item)]


def check_secret_origins(running: Mapping[str, Any], written: Mapping[str, Any], body: Any) -> None:
    """Refuse a provider (as it would be written) that sends a secret to an origin the running
    config does not send it to, unless the body carries that secret in full (module rule)."""
    bound = _all_bindings(running)
    given = _body_strings(body)
    for (kind, value, origin), where in secret_bindings(written).items():
        if (kind, value, origin) in bound:
            continue
        if kind == "var":
            raise ApiError(400, f"{where}: ${{{value}}} would be sent to {origin}, which the running config "
                                "does not send it to; give the value itself in this request, or edit the "
                                "config file by hand", code="secret_origin_changed", param=where)
        if not any(value in text for text in given):
            raise ApiError(400, f"{where}: a stored secret would be sent to {origin}, which it is not "
                                "configured for; re-supply it in full in this request",
                           code="secret_origin_changed", param=where)
