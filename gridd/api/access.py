"""Who may use the providers API (DESIGN 5; docs/security.md): a bearer token, or loopback only.

check_api_exposure refuses, at start and reload, an API without a token that listens beyond
loopback; bearer_matches compares a presented token in constant time; loopback_host tells
whether a Host header names this machine's loopback (a tokenless read must).
"""

from __future__ import annotations

import hmac
import ipaddress
import re

from gridd.config import Config
from gridd.errors import ConfigError
from gridd.http.listeners import parse_bind

__all__ = ["bearer_matches", "check_api_exposure", "loopback_host"]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name could resolve anywhere: only IP literals count


def check_api_exposure(cfg: Config) -> None:
    """Refuse an API that anyone on the network could use: without ``api.admin_token`` it
    may only listen on 127.0.0.0/8 or ::1. An empty token counts as unset (an unset
    ``${VAR:-}`` must not open the API to a blank bearer)."""
    bind = cfg.listen.http
    if bind is None or cfg.api.admin_token:
        return
    try:
        kind, host, _ = parse_bind(bind)
    except ValueError as exc:
        raise ConfigError(f"listen.http: {exc}") from None
    if kind != "tcp" or not _is_loopback(host):
        raise ConfigError(
            f"api.admin_token: required when the providers API listens beyond loopback "
            f"(listen.http is {bind!r}); set api.admin_token or bind 127.0.0.1 or [::1]")


def bearer_matches(authorization: list[bytes], token: str) -> bool:
    """Exactly one ``Authorization: Bearer <token>`` header, compared in constant time (the
    comparison leaks the length at most, never a matching prefix)."""
    if len(authorization) != 1:
        return False
    scheme, _, presented = authorization[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(presented.strip(), token.encode("utf-8"))


def loopback_host(host: str) -> bool:
    """A Host header naming this machine's loopback: an IP literal or "localhost", any port."""
    name = host.rpartition(":")[0] if re.search(r":\d+$", host) else host
    name = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    return name.lower() == "localhost" or _is_loopback(name)

