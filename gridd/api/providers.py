"""The operator's providers REST API (spec 004 Example 2; DESIGN.md 5 and 5b; docs/providers-api.md).

    GET    /v1/providers          every provider, as written in the config file, redacted
    GET    /v1/providers/{name}   one provider, redacted (404 if absent)
    POST   /v1/providers/{name}   create (201) or update (200)
    DELETE /v1/providers/{name}   remove (204)

The config file is the only store. A mutation edits the raw YAML tree the daemon runs
(``LoadedConfig.raw``: ``${VAR}`` placeholders as written), validates the whole new tree
with ``parse_config``, writes it atomically, and asks the daemon for the staged reload SIGHUP
runs; a rejected reload puts the previous file back. Mutations are serialized.

The pure part (redaction, the POST merge, tree edits, the token check) takes and returns
plain trees and never touches trio; ``ProvidersAPI`` only moves bytes between HTTP, the
file and the reload.
"""

from __future__ import annotations

import copy
import hmac
import ipaddress
import logging
import os
import pathlib
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import trio
import yaml

from gridd.config import Config, LoadedConfig, parse_config, placeholder_names
from gridd.errors import ConfigError, StateError
from gridd.http.asgi import ClientDisconnected, Receive, Scope, Send, send_simple
from gridd.http.listeners import parse_bind
from gridd.state import write_durably

__all__ = [
    "MASK",
    "MAX_BODY_BYTES",
    "ApiError",
    "ProvidersAPI",
    "bearer_matches",
    "check_api_exposure",
    "check_secret_origins",
    "delete_provider",
    "find_mask",
    "redact_provider",
    "render_config",
    "secret_bindings",
    "upsert_provider",
]

log = logging.getLogger("gridd.api")

Reload = Callable[[], Awaitable[Mapping[str, Any]]]
RunIO = Callable[..., Awaitable[Any]]

MASK = "***REDACTED***"
MAX_BODY_BYTES = 1024 * 1024
"""A POST body of exactly this many bytes is read; one byte more is 413."""
MAX_BODY_DEPTH = 32
"""Nesting a POST body may have. A valid provider needs about 8 levels; the bound keeps the
recursive steps after decoding (copy, YAML dump, config decode) far from Python's limit."""

LIST_PATH = "/v1/providers"
ITEM_PREFIX = "/v1/providers/"


class ApiError(Exception):
    """One error answer: ``{"error": {"message", "type", "param", "code"}}`` (DESIGN 5)."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 type_: str = "invalid_request_error", headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_
        self.headers = headers or []


# ---------------------------------------------------------------------------------------------
# Exposure: a token, or loopback only (DESIGN 5)


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


# ---------------------------------------------------------------------------------------------
# Redaction: GET must not hand out credentials, but must round-trip as a POST payload

# A custom header or query parameter whose name says it carries a credential (authorization,
# x-api-key, api-key, cookie, x-auth-token, sig, pwd, jwt, ...). Broad on purpose: a masked
# value costs a re-supply on POST; an unmasked one leaks.
_SECRET_HEADER = re.compile(r"auth|key|token|secret|passw|pwd|cookie|session|credential|sig|jwt", re.I)
# A value that reveals only environment variable names: one or more ``${VAR}`` (or ``${VAR:-}``,
# an empty default) after an optional scheme word ("Bearer ${TOKEN}"). A non-empty default
# (``${VAR:-sk-123}``) or any other literal text may be the secret itself and is masked.
_NAMES_ONLY = re.compile(r"[A-Za-z][A-Za-z0-9_-]* +(?=\$)|\$\{[A-Za-z_][A-Za-z0-9_]*(?::-)?\}")


def _names_only(value: str) -> bool:
    rest = _NAMES_ONLY.sub("", value, count=0)
    return rest == "" and "$" in value


def _masked(value: Any) -> Any:
    """A secret's value as GET shows it: null, "" and placeholders as written; else MASK."""
    if not isinstance(value, str) or value == "" or _names_only(value):
        return value
    return MASK


# scheme://authority path ?query #fragment, split by hand: urllib refuses a password holding
# "[" or "]" (it takes them for an IPv6 literal), and a URL it refuses must still be masked.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)(?P<path>[^?#]*)"
                  r"(?:\?(?P<query>[^#]*))?(?:#(?P<fragment>.*))?$", re.S)


class _UrlParts(msgspec.Struct, frozen=True):
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


def _split_url(value: str) -> _UrlParts | None:
    m = _URL.match(value)
    if m is None:
        return None
    userinfo, at, hostport = m.group("authority").rpartition("@")  # userinfo ends at the LAST @, as in httpx
    return _UrlParts(m.group("scheme"), userinfo if at else None, hostport, m.group("path"),
                     m.group("query"), m.group("fragment"))


def _url_secret_values(parts: _UrlParts) -> list[tuple[str, str]]:
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
    """Mask a URL's credentials (_url_secret_values) unless they name only placeholders. A URL
    with nothing to mask is returned byte for byte."""
    parts = _split_url(value)
    if parts is None:
        return value
    secrets = {where: v for where, v in _url_secret_values(parts) if not _names_only(v)}
    if not secrets:
        return value
    userinfo = parts.userinfo
    if "password" in secrets:
        userinfo = f"{parts.userinfo.partition(':')[0]}:{MASK}"
    elif "user" in secrets:
        userinfo = MASK
    query = parts.query
    if query and any(w.startswith("query ") for w in secrets):
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = urllib.parse.urlencode(
            [(k, MASK if f"query {k}" in secrets and v and not _names_only(v) else v) for k, v in pairs],
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


def _nesting_exceeds(node: Any, limit: int) -> bool:
    """True when containers nest deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


# ---------------------------------------------------------------------------------------------
# Secrets bound to their origin (docs/security.md)
#
# A secret is bound to the origin (scheme, host, port) it was configured for. A POST that
# would send a secret to an origin it is not bound to in the running config (a changed
# settings.endpoint, metrics.url or probe endpoint, a placeholder moved into another URL's
# query) is refused unless the request itself carries the secret in full: a literal value
# present in the body. A ``${VAR}`` placeholder is never "supplied": its value is the
# daemon's, so it may only go where the running config already sends it.

Binding = tuple[str, str, str]
"""("var", NAME, origin) or ("lit", value, origin)."""


def _origin_of(url: Any) -> str | None:
    parts = _split_url(url) if isinstance(url, str) else None
    return parts.origin() if parts is not None else None


def _secret_value_bindings(value: Any, origin: str, where: str, out: dict[Binding, str]) -> None:
    if not isinstance(value, str) or not value:
        return
    for name in placeholder_names(value):
        out.setdefault(("var", name, origin), where)
    if not _names_only(value):
        out.setdefault(("lit", value, origin), where)


def _auth_bindings(auth: Any, origin: str | None, where: str, out: dict[Binding, str]) -> None:
    if not isinstance(auth, dict) or origin is None:
        return
    _secret_value_bindings(auth.get("api_key"), origin, f"{where}.api_key", out)
    headers = auth.get("custom_headers")
    for name, value in (headers.items() if isinstance(headers, dict) else ()):
        _secret_value_bindings(value, origin, f"{where}.custom_headers.{name}", out)


def _url_bindings(url: Any, where: str, out: dict[Binding, str]) -> None:
    parts = _split_url(url) if isinstance(url, str) else None
    if parts is None:
        return
    origin = parts.origin()
    for _, value in _url_secret_values(parts):
        _secret_value_bindings(value, origin, where, out)
    # Any placeholder outside the host (path, query, userinfo) travels to that origin.
    for name in placeholder_names(url) - placeholder_names(parts.hostport):
        out.setdefault(("var", name, origin), where)


def secret_bindings(provider: Mapping[str, Any]) -> dict[Binding, str]:
    """Every (secret, origin) a provider, as written, sends, with the field it comes from.
    ``settings.auth`` goes to ``settings.endpoint``'s origin (and to probe and metrics URLs of
    that same origin, which binds nothing new); a URL's own ``auth`` block to that URL."""
    out: dict[Binding, str] = {}
    settings = provider.get("settings") if isinstance(provider.get("settings"), dict) else {}
    endpoint = settings.get("endpoint")
    _url_bindings(endpoint, "settings.endpoint", out)
    _auth_bindings(settings.get("auth"), _origin_of(endpoint), "settings.auth", out)
    probes = settings.get("probes")
    for i, probe in enumerate(probes if isinstance(probes, list) else ()):
        if not isinstance(probe, dict):
            continue
        where = f"settings.probes[{i}]"
        _url_bindings(probe.get("endpoint"), f"{where}.endpoint", out)
        _auth_bindings(probe.get("auth"), _origin_of(probe.get("endpoint") or endpoint), f"{where}.auth", out)
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
            raise ApiError(400, f"{where}: ${{{value}}} would be sent to {origin}, which the running config does "
                                "not send it to; give the value itself in this request, or edit the config file "
                                "by hand", code="secret_origin_changed", param=where)
        if not any(value in text for text in given):
            raise ApiError(400, f"{where}: a stored secret would be sent to {origin}, which it is not configured "
                                "for; re-supply it in full in this request", code="secret_origin_changed",
                           param=where)


# ---------------------------------------------------------------------------------------------
# Tree edits (the raw tree is never modified in place)


def _providers(tree: dict[str, Any]) -> list[Any]:
    providers = tree.get("providers")
    if providers is None:
        providers = tree["providers"] = []
    return providers


def find_provider(raw: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for provider in raw.get("providers") or []:
        if isinstance(provider, dict) and provider.get("name") == name:
            return provider
    return None


def upsert_provider(raw: Mapping[str, Any], name: str,
                    fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(new tree, the provider as it will be written, created?). DESIGN 5b: each top-level
    field in ``fields`` replaces the stored one whole (``settings`` included); absent fields
    are kept. A ``name`` in the body must be the path's."""
    if "name" in fields and fields["name"] != name:
        raise ApiError(400, f"the body names provider {fields['name']!r} but the path names {name!r}; "
                            "omit `name` or make them match", code="name_mismatch", param="name")
    given = {k: v for k, v in fields.items() if k != "name"}
    tree = copy.deepcopy(dict(raw))
    providers = _providers(tree)
    for i, provider in enumerate(providers):
        if isinstance(provider, dict) and provider.get("name") == name:
            providers[i] = {**provider, **given}  # stored order kept; new fields go last
            return tree, providers[i], False
    created = {"name": name, **given}
    providers.append(created)
    return tree, created, True


def delete_provider(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    tree = copy.deepcopy(dict(raw))
    providers = _providers(tree)
    kept = [p for p in providers if not (isinstance(p, dict) and p.get("name") == name)]
    if len(kept) == len(providers):
        raise _not_found(name)
    tree["providers"] = kept
    return tree


def render_config(tree: Mapping[str, Any]) -> str:
    """The YAML written back: keys in their order, placeholders as written. Comments and
    layout of the original file are not kept (docs/providers-api.md)."""
    return yaml.safe_dump(dict(tree), sort_keys=False, allow_unicode=True, default_flow_style=False, width=100)


def _config_error_param(message: str) -> str | None:
    head = message.split(": ", 1)[0]
    return head if re.fullmatch(r"[A-Za-z_][\w.\[\]-]*", head) else None


def _not_found(name: str) -> ApiError:
    return ApiError(404, f"no provider named {name!r}", code="provider_not_found", param="name")


# ---------------------------------------------------------------------------------------------
# File IO (blocking: called through run_io, off the event loop)


def _read_unchanged(path: pathlib.Path, running: Mapping[str, Any]) -> bytes:
    """The config file's bytes, provided they are the tree the daemon runs. A file edited by
    hand and not reloaded (or whose reload was rejected) would otherwise be overwritten
    without anyone seeing the edit."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ApiError(500, f"{path}: cannot read the config file: {exc.strerror or exc}",
                       code="config_unreadable", type_="server_error") from None
    try:
        on_disk = yaml.safe_load(data) or {}
    except yaml.YAMLError:
        on_disk = None
    if on_disk != running:
        raise ApiError(409, f"{path} differs from the running config (edited and not reloaded, or its "
                            "reload was rejected); reload it (gridctl reload) or fix it, then retry",
                       code="config_changed_on_disk")
    return data


def _write_config(path: pathlib.Path, data: bytes) -> None:
    """write_durably with the file's permission bits kept, so a config holding a literal
    api_key is never rewritten under the umask's wider bits."""
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = 0o600
    write_durably(path, data, mode=mode)


# ---------------------------------------------------------------------------------------------
# The ASGI app

_json = msgspec.json.Encoder()


class ProvidersAPI:
    """ASGI 3 app. ``loaded`` returns the config the daemon runs now; ``reload`` runs the
    daemon's staged reload and returns its outcome ({"result": "ok"|"error", "error"});
    ``env`` resolves placeholders while validating (the process environment by default);
    ``run_io`` runs blocking file IO (a worker thread by default)."""

    def __init__(self, *, loaded: Callable[[], LoadedConfig], reload: Reload,
                 write_token: Callable[[], str | None] = lambda: None,
                 env: Mapping[str, str] | None = None, run_io: RunIO = trio.to_thread.run_sync,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self._loaded = loaded
        self._reload = reload
        self._write_token = write_token
        self._env = env
        self._run_io = run_io
        self.max_body_bytes = max_body_bytes
        # One mutation at a time: each builds on the tree the previous one committed.
        self._lock = trio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            try:
                self._authorize(scope)
                status, payload, headers = await self._route(scope, receive)
            except ApiError as exc:
                body = _json.encode({"error": {"message": exc.message, "type": exc.type,
                                               "param": exc.param, "code": exc.code}})
                await send_simple(send, exc.status, body, b"application/json", exc.headers)
                return
            if payload is None:
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": b""})
            else:
                await send_simple(send, status, _json.encode(payload), b"application/json", headers)
        except ClientDisconnected:
            return

    def _authorize(self, scope: Scope) -> None:
        """DESIGN (docs/security.md): writes always need a token, the admin token or the token
        file's; reads need one too unless the API serves on loopback without an admin token.
        A browser can neither read nor write: any Origin header is refused (a page's fetch
        sends one), and a loopback read without a token must name a loopback Host (a DNS
        rebinding page names its own)."""
        headers = scope["headers"]
        if any(k.lower() == b"origin" for k, _ in headers):
            raise ApiError(403, "requests from a web page (with an Origin header) are refused",
                           code="cross_origin_refused", type_="permission_error")
        admin = self._loaded().config.api.admin_token
        tokens = [t for t in (admin, self._write_token()) if t]
        presented = [v for k, v in headers if k.lower() == b"authorization"]
        if any(bearer_matches(presented, t) for t in tokens):
            return
        if not admin and not presented and scope["method"] in ("GET", "HEAD"):
            host = next((v for k, v in headers if k.lower() == b"host"), b"").decode("latin-1")
            if _loopback_host(host):
                return  # loopback only: check_api_exposure refused anything else at start and reload
            raise ApiError(403, f"Host {host!r} is not a loopback address; reading without a token is for "
                                "loopback clients only", code="host_refused", type_="permission_error")
        what = "api.admin_token" if admin else "the token in the state directory's api-token file (gridctl reads it)"
        raise ApiError(401, f"a valid bearer token is required (Authorization: Bearer <{what}>)",
                       code="invalid_api_key", type_="authentication_error",
                       headers=[(b"www-authenticate", b'Bearer realm="gridd providers API"')])

    async def _route(self, scope: Scope,
                     receive: Receive) -> tuple[int, Any, list[tuple[bytes, bytes]]]:
        path, method = scope["path"], scope["method"]
        if path == LIST_PATH:
            if method != "GET":
                raise _method_not_allowed(method, path, b"GET")
            raw = self._loaded().raw
            data = [redact_provider(p) for p in raw.get("providers") or [] if isinstance(p, dict)]
            return 200, {"object": "list", "data": data}, []
        name = path[len(ITEM_PREFIX):] if path.startswith(ITEM_PREFIX) else ""
        if not name or "/" in name:
            raise ApiError(404, f"Invalid URL ({method} {path})", code="not_found")
        if method == "GET":
            provider = find_provider(self._loaded().raw, name)
            if provider is None:
                raise _not_found(name)
            return 200, redact_provider(provider), []
        if method == "POST":
            _require_json(scope)
            fields = await self._read_json(receive)
            masked_at = find_mask(fields)
            if masked_at is not None:
                raise ApiError(400, f"{masked_at}: the value is the redaction mask {MASK!r}; re-supply the real "
                                    "value or a ${VAR} placeholder", code="redacted_value", param=masked_at)
            written, created = await self._mutate(lambda raw: upsert_provider(raw, name, fields),
                                                  guard=lambda running, provider: check_secret_origins(
                                                      running, provider, fields))
            headers = [(b"location", f"{ITEM_PREFIX}{name}".encode())] if created else []
            return (201 if created else 200), redact_provider(written), headers
        if method == "DELETE":
            await self._mutate(lambda raw: (delete_provider(raw, name), None, False))
            return 204, None, []
        raise _method_not_allowed(method, path, b"GET, POST, DELETE")

    async def _read_json(self, receive: Receive) -> dict[str, Any]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientDisconnected("client went away during the request body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"request body larger than {self.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            fields = msgspec.json.decode(b"".join(chunks))
        except (msgspec.DecodeError, RecursionError) as exc:
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ApiError(400, f"the request body is not valid JSON: {detail}", code="invalid_json") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the request body must be a JSON object of provider fields", code="invalid_json")
        if _nesting_exceeds(fields, MAX_BODY_DEPTH):
            raise ApiError(400, f"the request body is not valid JSON: nested deeper than {MAX_BODY_DEPTH} levels",
                           code="invalid_json")
        return fields

    async def _mutate(self, edit: Callable[[dict[str, Any]], tuple[dict[str, Any], Any, bool]],
                      guard: Callable[[dict[str, Any], Any], None] | None = None) -> tuple[Any, bool]:
        """Edit, validate, persist, reload; on a rejected reload, put the old file back.
        ``guard(running raw tree, provider as written)`` may refuse the edit (ApiError)."""
        async with self._lock:
            loaded = self._loaded()
            tree, written, created = edit(loaded.raw)
            # A placeholder resolves from the daemon's environment: a caller could otherwise
            # send any variable it names (a token, a password) to an endpoint of its choice.
            # Only names the running config already uses may appear.
            unknown = sorted(placeholder_names(tree) - placeholder_names(loaded.raw))
            if unknown:
                raise ApiError(400, "placeholders the running config does not use: "
                                    + ", ".join(f"${{{n}}}" for n in unknown)
                                    + "; add them to the config file by hand first",
                               code="unknown_placeholder")
            if guard is not None:
                guard(loaded.raw, written)
            text = render_config(tree)
            try:
                _, reparsed = await self._run_io(self._validate, text, str(loaded.path))
            except ConfigError as exc:
                raise ApiError(400, str(exc), code="invalid_config", param=_config_error_param(str(exc))) from None
            if reparsed != tree:
                raise ApiError(500, "the config would not read back as written; nothing was changed",
                               code="render_mismatch", type_="server_error")
            previous = await self._run_io(_read_unchanged, loaded.path, loaded.raw)
            try:
                await self._run_io(_write_config, loaded.path, text.encode("utf-8"))
            except StateError as exc:
                raise ApiError(500, str(exc), code="config_not_written", type_="server_error") from None
            outcome = await self._reload()
            if outcome.get("result") != "ok":
                reason = outcome.get("error") or "unknown reason"
                try:
                    await self._run_io(_write_config, loaded.path, previous)
                except StateError as exc:
                    log.error("providers API: reload rejected and the previous config not restored: %s", exc)
                    raise ApiError(500, f"the reload was rejected ({reason}) and the previous config could not "
                                        f"be restored: {exc}", code="config_not_restored",
                                   type_="server_error") from None
                log.warning("providers API: reload rejected, previous config restored: %s", reason)
                raise ApiError(409, f"the daemon rejected the new config; the previous file is restored: {reason}",
                               code="reload_rejected")
            return written, created

    def _validate(self, text: str, source: str) -> tuple[Config, dict[str, Any]]:
        return parse_config(text, env=None if self._env is None else dict(self._env), source=source)


def _loopback_host(host: str) -> bool:
    """A Host header naming this machine's loopback: an IP literal or "localhost", any port."""
    name = host.rpartition(":")[0] if re.search(r":\d+$", host) else host
    name = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    return name.lower() == "localhost" or _is_loopback(name)


def _require_json(scope: Scope) -> None:
    """A write's body must be declared application/json: a web form or a text/plain "simple
    request" (no CORS preflight) is refused before its body is read."""
    declared = [v for k, v in scope["headers"] if k.lower() == b"content-type"]
    media = declared[0].split(b";", 1)[0].strip().lower() if len(declared) == 1 else b""
    if media != b"application/json":
        raise ApiError(415, "the request body must be sent as Content-Type: application/json",
                       code="unsupported_media_type", param="content-type")


def _method_not_allowed(method: str, path: str, allow: bytes) -> ApiError:
    return ApiError(405, f"{method} is not allowed on {path}; use {allow.decode()}", code="method_not_allowed",
                    headers=[(b"allow", allow)])
