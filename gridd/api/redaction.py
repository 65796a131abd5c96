"""Redaction: GET must not hand out credentials, but its answer must round-trip as a POST
payload. redact_provider masks a provider's secrets (placeholders stay as written: they name a
variable, not its value); find_mask finds the mask in a POST body, which must never be
persisted. The URL reading here (split_url, url_secret_values) is shared with secret_origins.
"""

from __future__ import annotations

import copy
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = [
    "MASK",
    "UrlParts",
    "find_mask",
    "names_only",
    "redact_provider",
    "split_url",
    "url_secret_values",
]

MASK = "***REDACTED***"

# A custom header or query parameter whose name says it carries a credential (authorization,
# x-api-key, api-key, cookie, x-auth-token, sig, pwd, jwt, ...). Broad on purpose: a masked
# value costs a re-supply on POST; an unmasked one leaks.
_SECRET_HEADER = re.compile(r"auth|key|token|secret|passw|pwd|cookie|session|credential|sig|jwt", re.I)
# A value that reveals only environment variable names: one or more ``${VAR}`` (or ``${VAR:-}``,
# an empty default) after an optional scheme word ("Bearer ${TOKEN}"). A non-empty default
# (``${VAR:-sk-123}``) or any other literal text may be the secret itself and is masked.
_NAMES_ONLY = re.compile(r"[A-Za-z][A-Za-z0-9_-]* +(?=\$)|\$\{[A-Za-z_][A-Za-z0-9_]*(?::-)?\}")


def names_only(value: str) -> bool:
    rest = _NAMES_ONLY.sub("", value, count=0)
    return rest == "" and "$" in value


def _masked(value: Any) -> Any:
    """A secret's value as GET shows it: null, "" and placeholders as written; else MASK."""
    if not isinstance(value, str) or value == "" or names_only(value):
        return value
    return MASK


# scheme://authority path ?query #fragment, split by hand: urllib refuses a password holding
# "[" or "]" (it takes them for an IPv6 literal), and a URL it refuses must still be masked.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)(?P<path>[^?#]*)"
                  r"(?:\?(?P<query>[^#]*))?(?:#(?P<fragment>.*))?$", re.S)


class UrlParts(msgspec.Struct, frozen=True):
    scheme: str
    userinfo: str | None
    hostport: str
    path: str
    query: str | None
    fragment: str | None

    def origin(self) -> str:
        """scheme://host:port as written, lower-cased, the scheme's default port filled in."""
        hostport = self.hostport.lower()
        if not re.search(r":\d+$", hostport):
            port = {"http": 80, "https": 443, "ws": 80, "wss": 443}.get(self.scheme.lower())
            hostport = f"{hostport}:{port}" if port else hostport
        return f"{self.scheme.lower()}://{hostport}"


def split_url(value: str) -> UrlParts | None:
    m = _URL.match(value)
    if m is None:
        return None
    userinfo, at, hostport = m.group("authority").rpartition("@")  # userinfo ends at the LAST @, as in httpx
    return UrlParts(m.group("scheme"), userinfo if at else None, hostport, m.group("path"),
                     m.group("query"), m.group("fragment"))


def url_secret_values(parts: UrlParts) -> list[tuple[str, str]]:
    """(where, value) of every credential a URL carries: the password of user:password (or a
    token given as the user name alone), credential-named query parameters, the fragment."""
    found: list[tuple[str, str]] = []
    if parts.userinfo:
        user, colon, password = parts.userinfo.partition(":")
        if colon and password:
            found.append(("password", password))
        elif not colon and user:
            found.append(("user", user))
    if parts.query:
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if value and _SECRET_HEADER.search(key):
                found.append((f"query {key}", value))
    if parts.fragment:
        found.append(("fragment", parts.fragment))
    return found


def _mask_url(value: str) -> str:
    """Mask a URL's credentials (url_secret_values) unless they name only placeholders. A URL
    with nothing to mask is returned byte for byte."""
    parts = split_url(value)
    if parts is None:
        return value
    secrets = {where: v for where, v in url_secret_values(parts) if not names_only(v)}
    if not secrets:
        return value
    userinfo = parts.userinfo
    if "password" in secrets and userinfo is not None:  # a password is only found in a userinfo
        userinfo = f"{userinfo.partition(':')[0]}:{MASK}"
    elif "user" in secrets:
        userinfo = MASK
    query = parts.query
    if query and any(w.startswith("query ") for w in secrets):
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = urllib.parse.urlencode(
            [(k, MASK if f"query {k}" in secrets and v and not names_only(v) else v) for k, v in pairs],
            safe="*${}:-")
    out = f"{parts.scheme}://{userinfo + '@' if userinfo is not None else ''}{parts.hostport}{parts.path}"
    if query is not None:
        out += f"?{query}"
    if parts.fragment is not None:
        out += f"#{MASK if 'fragment' in secrets else parts.fragment}"
    return out


def _mask_url_passwords(node: Any) -> Any:
    if isinstance(node, str):
        return _mask_url(node) if "://" in node else node
    if isinstance(node, dict):
        return {k: _mask_url_passwords(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_mask_url_passwords(v) for v in node]
    return node


def redact_provider(provider: Mapping[str, Any]) -> dict[str, Any]:
    """The provider as written in the config file with its secrets masked: ``settings.auth.
    api_key``, credential-looking ``settings.auth.custom_headers`` values, and the password of
    any ``scheme://user:password@`` URL. Placeholders stay as written (they name a variable,
    not its value)."""
    out = _mask_url_passwords(copy.deepcopy(dict(provider)))
    auth = out.get("settings", {}).get("auth") if isinstance(out.get("settings"), dict) else None
    if isinstance(auth, dict):
        if "api_key" in auth:
            auth["api_key"] = _masked(auth["api_key"])
        headers = auth.get("custom_headers")
        if isinstance(headers, dict):
            auth["custom_headers"] = {name: _masked(v) if _SECRET_HEADER.search(str(name)) else v
                                      for name, v in headers.items()}
    return out


def _fmt(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def find_mask(node: Any, parts: list[str | int] | None = None) -> str | None:
    """The path of the first string in a POST body that carries MASK (spec 004, Secrets
    caveat: persisting the mask would replace the real credential with the literal mask)."""
    parts = [] if parts is None else parts
    if isinstance(node, str):
        return _fmt(parts) if MASK in node else None
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found = find_mask(value, [*parts, key])
        if found is not None:
            return found
    return None
