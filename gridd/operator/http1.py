"""The scrape path's HTTP/1.1 GET client: keep-alive per provider over trio streams.

Scraping 1000 providers a second through httpx cost about 0.9 ms of CPU per scrape in the
client stack alone (docs/scaling.md): httpcore scans its whole connection list on every
request event, so its pool stays small and every scrape dialled and closed a connection.
A scrape needs one thing from HTTP: GET a URL, read at most ``body_cap`` bytes of a 2xx
body. This module does only that, in two layers (STYLE 1):

``ResponseParser`` (gridd.operator.http1_parser, sans-IO, no trio): bytes in, one response
out, RFC 9112 framing as h11 reads it, the body cap counted in decoded bytes.

``ScrapeClient`` (the trio shell): one idle connection list per origin (scheme, host,
port), reused while it has been idle at most ``keepalive_expiry_s`` (30 s: longer than
httpx's 5 s, so that scrape intervals and passes up to 30 s keep their connections; a
provider that closes idle connections sooner costs one retry, below; it is far below the
idle timeouts of NATs and firewalls, which drop a connection silently), up to ``max_idle``
idle connections in all (each is a file descriptor; half the soft RLIMIT_NOFILE, at most
4096). It has no limit of its own on concurrent requests: the scrape pool's bound is the
one queue (STYLE 8). A plain-TCP connection is read and written on its own socket, a TLS
one through trio.SSLStream (_Connection).
It sets no timeout: the caller's cancel scope bounds a scrape (STYLE 3); a cancelled or
failed exchange closes its connection, so only a connection that ended a complete
response cleanly is reused. GET is idempotent, so a reused connection that the server
closed while idle (no byte of an answer came back) is retried once on a new connection.
Errors are mapped here, at the layer edge (STYLE 4), to the scrape failure classes:
"tls" (any ssl error in the cause chain), "connect" (refused, reset, closed early, or a
malformed response, as httpx's RemoteProtocolError was), "http_status", "body_cap",
"parse" (a body that does not decode).
"""

from __future__ import annotations

import base64
import re
import resource
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import unquote, urlsplit

import trio

from gridd.http import sockio
from gridd.operator.http1_parser import (
    HEAD_MAX,
    BodyCapExceeded,
    ProtocolError,
    ResponseParser,
    UndecodableBody,
)

__all__ = [
    "HEAD_MAX",
    "BodyCapExceeded",
    "ProtocolError",
    "ResponseParser",
    "ScrapeClient",
    "UndecodableBody",
    "is_tls_error",
]

REQUESTS_CACHED = 8192
"""Targets whose request bytes are kept built (more than any operator's providers)."""
RECEIVE_BYTES = 64 * 1024
"""Bytes asked of a TLS or injected stream per read (each read allocates this much first)."""
RECEIVE_BUFFER_BYTES = 256 * 1024
"""Bytes a plain connection's read may take, into the client's one reusable buffer: a 75 KB
exposition that has arrived is read at once."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def is_tls_error(exc: BaseException) -> bool:
    """Whether an ssl error is ``exc`` or in its cause/context chain (trio and httpx wrap it)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError | ssl.CertificateError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


Origin = tuple[str, str, int]


def _broken(exc: OSError) -> trio.BrokenResourceError:
    # The error trio's SocketStream raises for the same failure, so a scrape's failure
    # detail reads as it did before plain connections bypassed it.
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


class _Connection:
    """One connection to an origin. A plain TCP connection is read and written on its own
    non-blocking stdlib socket (``sock``), waiting in trio only when the kernel has nothing
    to give: trio's SocketStream tries every read before waiting (after a request is sent,
    one wasted EAGAIN and one more wait) and passes through the scheduler after every call
    that returned at once, several rounds per scrape (docs/scaling.md). TLS connections and
    injected streams (tests) go through ``stream``."""

    __slots__ = ("stream", "sock", "origin", "idle_since")

    def __init__(self, origin: Origin, *, stream: trio.abc.Stream | None = None,
                 sock: socket.socket | None = None) -> None:
        self.stream = stream
        self.sock = sock
        self.origin = origin
        self.idle_since = 0.0

    async def send_all(self, data: bytes) -> None:
        sock = self.sock
        if sock is None:
            assert self.stream is not None
            await self.stream.send_all(data)
            return
        try:
            await sockio.send_all(sock, data)
        except OSError as exc:
            raise _broken(exc) from exc

    async def receive(self, into: memoryview, *, wait_first: bool) -> bytes | bytearray | memoryview:
        """Bytes read into ``into`` (a view of them, valid until the next read), or b"" at
        the end of the connection. ``wait_first``: the answer cannot be there yet (the
        request was just sent), so wait for it before reading."""
        sock = self.sock
        if sock is None:
            assert self.stream is not None
            return await self.stream.receive_some(RECEIVE_BYTES)
        try:
            return into[: await sockio.receive_into(sock, into, wait_first=wait_first)]
        except OSError as exc:
            raise _broken(exc) from exc

    async def aclose(self) -> None:
        """Close now, whatever state the connection is in."""
        sock = self.sock
        if sock is not None:
            trio.lowlevel.notify_closing(sock)
            sock.close()
        elif self.stream is not None:
            await trio.aclose_forcefully(self.stream)


class _StaleConnection(Exception):
    """A reused connection ended before any byte of an answer: the server closed it idle."""


def _default_max_idle() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else max(16, min(4096, soft // 2))


_DEFAULT_HEADERS = {
    "accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    # identity: the body cap counts decoded bytes (see _Decoder for a server that
    # compresses anyway).
    "accept-encoding": "identity",
    "user-agent": "gridd-scrape",
}

Outcome = tuple[bytes | None, str | None, str]


class ScrapeClient:
    """GET with a body cap over kept-alive connections (module docstring). Use as an async
    context manager, or call ``aclose``; ``get_capped`` answers like scrape.fetch_capped."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool = True,
        max_idle: int | None = None,
        keepalive_expiry_s: float = 30.0,
        open_stream: Callable[[str, int], Awaitable[trio.abc.Stream]] = trio.open_tcp_stream,
    ) -> None:
        # open_stream(host, port): tests pass in-memory streams (STYLE 12).
        self._open_stream = open_stream
        self._verify = verify
        self._ssl_context: ssl.SSLContext | None = verify if isinstance(verify, ssl.SSLContext) else None
        self.max_idle = _default_max_idle() if max_idle is None else max_idle
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: dict[Origin, list[_Connection]] = {}
        # (url, header items) -> (origin, request bytes): targets repeat every pass.
        self._requests: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Origin, bytes]] = {}
        self._idle_count = 0
        self._closed = False
        # Every read of a plain connection lands here first (no allocation per read); only
        # one task runs at a time and a read's bytes are consumed before the next await.
        self._receive_view = memoryview(bytearray(RECEIVE_BUFFER_BYTES))
        # For tests and the benchmark: connections dialled, and requests sent on a reused one.
        self.connections_opened = 0
        self.reused = 0

    async def __aenter__(self) -> ScrapeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle, self._idle_count = self._idle, {}, 0
        for connections in idle.values():
            for connection in connections:
                await connection.aclose()

    async def get_capped(self, url: str, headers: Mapping[str, str], body_cap: int) -> Outcome:
        """GET ``url``: (body, None, "") for a 2xx body of at most ``body_cap`` decoded bytes,
        else (None, failure class, detail)."""
        key = (url, tuple(headers.items()))
        built = self._requests.get(key)
        if built is None:
            try:
                built = _request(url, headers)
            except (ValueError, UnicodeError) as exc:
                # A target that cannot be sent fails like an unreachable one, alone.
                return None, "connect", f"cannot send the request: {type(exc).__name__}: {exc}"
            if len(self._requests) >= REQUESTS_CACHED:
                self._requests.clear()  # targets changed on a reload: start over
            self._requests[key] = built
        origin, request = built
        try:
            try:
                return await self._exchange(origin, request, body_cap, reuse=True)
            except _StaleConnection:
                return await self._exchange(origin, request, body_cap, reuse=False)
        except ProtocolError as exc:
            return None, "connect", f"malformed response: {exc}"
        except BodyCapExceeded:
            return None, "body_cap", f"body over {body_cap} bytes"
        except UndecodableBody as exc:
            return None, "parse", f"undecodable body: {exc}"
        except (OSError, trio.BrokenResourceError, ssl.SSLError, ssl.CertificateError) as exc:
            if is_tls_error(exc):
                return None, "tls", f"TLS: {exc.__cause__ or exc}"
            return None, "connect", f"{type(exc).__name__}: {exc}"
        except (ValueError, UnicodeError) as exc:
            # A host name the resolver refuses (trio encodes it with IDNA: "a..b" is a
            # UnicodeError): unreachable, and never a crash of the pool.
            return None, "connect", f"cannot send the request: {type(exc).__name__}: {exc}"

    async def _exchange(self, origin: Origin, request: bytes, body_cap: int, *, reuse: bool) -> Outcome:
        connection = await self._checkout(origin) if reuse else None
        reused = connection is not None
        if connection is None:
            connection = await self._connect(origin)
        else:
            self.reused += 1
        keep = False
        try:
            parser = ResponseParser(body_cap)
            into = self._receive_view
            try:
                await connection.send_all(request)
                reads = 0
                while not parser.done:
                    data = await connection.receive(into, wait_first=not reads)
                    reads += 1
                    if data:
                        parser.receive_data(data)
                    else:
                        parser.receive_eof()
                    if not reads % 16:
                        # A long body that keeps arriving as fast as it is read never waits:
                        # let the other scrapes run between its reads.
                        await trio.lowlevel.checkpoint()
            except (ProtocolError, trio.BrokenResourceError, OSError) as exc:
                if reused and not parser.received_any and not is_tls_error(exc):
                    raise _StaleConnection from exc
                raise
            status = parser.status
            if status is None or not 200 <= status < 300:
                return None, "http_status", f"HTTP {status}"
            keep = parser.reusable
            return parser.body(), None, ""
        finally:
            if keep and not self._closed and self._idle_count < self.max_idle:
                connection.idle_since = trio.current_time()
                self._idle.setdefault(origin, []).append(connection)
                self._idle_count += 1
            else:
                await connection.aclose()

    async def _checkout(self, origin: Origin) -> _Connection | None:
        connections = self._idle.get(origin)
        now = trio.current_time()
        while connections:
            connection = connections.pop()
            self._idle_count -= 1
            if now - connection.idle_since <= self.keepalive_expiry_s:
                return connection
            # Idle too long: the server may close it any moment (uvicorn after 5 s).
            await connection.aclose()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        stream = await self._open_stream(host, port)
        self.connections_opened += 1
        if scheme == "https":
            tls = trio.SSLStream(stream, self._context(), server_hostname=host, https_compatible=True)
            try:
                await tls.do_handshake()
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            return _Connection(origin, stream=tls)
        if isinstance(stream, trio.SocketStream):
            # Plain TCP: its stdlib socket from here on (_Connection). SocketStream has set
            # TCP_NODELAY on it; detach() hands over the descriptor, trio's wrapper keeps none.
            sock = socket.socket(fileno=stream.socket.detach())
            sock.setblocking(False)
            return _Connection(origin, sock=sock)
        return _Connection(origin, stream=stream)

    def _context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            # httpx's own default (certifi's bundle, or no verification for verify=False), so a
            # target verifies exactly as it did through httpx.
            import httpx

            self._ssl_context = httpx.create_ssl_context(verify=self._verify)
        return self._ssl_context


def _request(url: str, headers: Mapping[str, str]) -> tuple[Origin, bytes]:
    """The origin to connect to and the request's bytes. ValueError for a URL that is not
    http(s)://host[:port]/..., UnicodeError or ValueError for a header that cannot be sent."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"not an http or https URL: {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    default_port = 443 if scheme == "https" else 80
    port = parts.port or default_port  # .port raises ValueError for a bad port
    authority = f"[{host}]" if ":" in host else host
    if port != default_port:
        authority += f":{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    fields = dict(_DEFAULT_HEADERS)
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        fields["authorization"] = "Basic " + base64.b64encode(credentials).decode()
    for name, value in headers.items():
        if _TOKEN.fullmatch(name) is None or any(c in value for c in "\r\n\0"):
            raise ValueError(f"header {name!r} cannot be sent")
        fields[name.lower()] = value
    lines = [f"GET {target} HTTP/1.1", f"host: {authority}", *(f"{k}: {v}" for k, v in fields.items())]
    # ascii, as httpx encodes header values: anything else is a UnicodeEncodeError here.
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    if any(c in target for c in " \r\n\0"):
        raise ValueError(f"cannot send the path {target!r}")
    return (scheme, host, port), request
