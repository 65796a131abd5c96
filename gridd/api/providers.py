"""The operator's providers REST API (spec 004 Example 2; DESIGN.md 5 and 5b; docs/providers-api.md).

    GET    /v1/providers          every provider, as written in the config file, redacted
    GET    /v1/providers/{name}   one provider, redacted (404 if absent)
    POST   /v1/providers/{name}   create (201) or update (200)
    DELETE /v1/providers/{name}   remove (204)

The config file is the only store. A mutation edits the raw YAML tree the daemon runs
(``LoadedConfig.raw``: ``${VAR}`` placeholders as written), validates the whole new tree
with ``parse_config``, writes it atomically, and asks the daemon for the staged reload SIGHUP
runs; a rejected reload puts the previous file back. Mutations are serialized.

This module holds the routes and the request checks. The pure parts take and return plain
trees and never touch trio: access (the token check, loopback only), redaction,
secret_origins, config_edits (the POST merge, tree edits); config_file reads and writes the
file. ``ProvidersAPI`` only moves bytes between HTTP, the file and the reload.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import trio

from gridd.api.access import bearer_matches, loopback_host
from gridd.api.config_edits import (
    delete_provider,
    find_provider,
    provider_not_found,
    render_config,
    upsert_provider,
)
from gridd.api.config_file import read_unchanged, write_config
from gridd.api.errors import ApiError
from gridd.api.redaction import MASK, find_mask, redact_provider
from gridd.api.secret_origins import check_secret_origins
from gridd.config import LoadedConfig, parse_config, placeholder_names
from gridd.config_schema import Config
from gridd.errors import ConfigError, StateError
from gridd.http.asgi import ClientDisconnected, Receive, Scope, Send, send_simple

__all__ = ["ITEM_PREFIX", "LIST_PATH", "MAX_BODY_BYTES", "MAX_BODY_DEPTH", "ProvidersAPI"]

log = logging.getLogger("gridd.api")

Reload = Callable[[], Awaitable[Mapping[str, Any]]]
RunIO = Callable[..., Awaitable[Any]]

MAX_BODY_BYTES = 1024 * 1024
"""A POST body of exactly this many bytes is read; one byte more is 413."""
MAX_BODY_DEPTH = 32
"""Nesting a POST body may have. A valid provider needs about 8 levels; the bound keeps the
recursive steps after decoding (copy, YAML dump, config decode) far from Python's limit."""

LIST_PATH = "/v1/providers"
ITEM_PREFIX = "/v1/providers/"


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


def _config_error_param(message: str) -> str | None:
    head = message.split(": ", 1)[0]
    return head if re.fullmatch(r"[A-Za-z_][\w.\[\]-]*", head) else None


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
            if loopback_host(host):
                return  # loopback only: check_api_exposure refused anything else at start and reload
            raise ApiError(403, f"Host {host!r} is not a loopback address; reading without a token is for "
                                "loopback clients only", code="host_refused", type_="permission_error")
        what = ("api.admin_token" if admin
                else "the token in the state directory's api-token file (gridctl reads it)")
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
                raise provider_not_found(name)
            return 200, redact_provider(provider), []
        if method == "POST":
            _require_json(scope)
            fields = await self._read_json(receive)
            masked_at = find_mask(fields)
            if masked_at is not None:
                raise ApiError(400, f"{masked_at}: the value is the redaction mask {MASK!r}; re-supply the "
                                    "real value or a ${VAR} placeholder", code="redacted_value",
                               param=masked_at)
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
            raise ApiError(400, f"the request body is not valid JSON: {detail}",
                           code="invalid_json") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the request body must be a JSON object of provider fields",
                           code="invalid_json")
        if _nesting_exceeds(fields, MAX_BODY_DEPTH):
            raise ApiError(400, "the request body is not valid JSON: nested deeper than "
                                f"{MAX_BODY_DEPTH} levels", code="invalid_json")
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
                raise ApiError(400, str(exc), code="invalid_config",
                               param=_config_error_param(str(exc))) from None
            if reparsed != tree:
                raise ApiError(500, "the config would not read back as written; nothing was changed",
                               code="render_mismatch", type_="server_error")
            previous = await self._run_io(read_unchanged, loaded.path, loaded.raw)
            try:
                await self._run_io(write_config, loaded.path, text.encode("utf-8"))
            except StateError as exc:
                raise ApiError(500, str(exc), code="config_not_written", type_="server_error") from None
            outcome = await self._reload()
            if outcome.get("result") != "ok":
                reason = outcome.get("error") or "unknown reason"
                try:
                    await self._run_io(write_config, loaded.path, previous)
                except StateError as exc:
                    log.error("providers API: reload rejected and the previous config not restored: %s", exc)
                    raise ApiError(500, f"the reload was rejected ({reason}) and the previous config could "
                                        f"not be restored: {exc}", code="config_not_restored",
                                   type_="server_error") from None
                log.warning("providers API: reload rejected, previous config restored: %s", reason)
                raise ApiError(409, "the daemon rejected the new config; the previous file is restored: "
                                    f"{reason}", code="reload_rejected")
            return written, created

    def _validate(self, text: str, source: str) -> tuple[Config, dict[str, Any]]:
        return parse_config(text, env=None if self._env is None else dict(self._env), source=source)


def _require_json(scope: Scope) -> None:
    """A write's body must be declared application/json: a web form or a text/plain "simple
    request" (no CORS preflight) is refused before its body is read."""
    declared = [v for k, v in scope["headers"] if k.lower() == b"content-type"]
    media = declared[0].split(b";", 1)[0].strip().lower() if len(declared) == 1 else b""
    if media != b"application/json":
        raise ApiError(415, "the request body must be sent as Content-Type: application/json",
                       code="unsupported_media_type", param="content-type")


def _method_not_allowed(method: str, path: str, allow: bytes) -> ApiError:
    return ApiError(405, f"{method} is not allowed on {path}; use {allow.decode()}",
                    code="method_not_allowed", headers=[(b"allow", allow)])
