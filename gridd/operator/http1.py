"""The scrape path's HTTP/1.1 GET client: keep-alive per provider over trio streams.

Scraping 1000 providers a second through httpx cost about 0.9 ms of CPU per scrape in the
client stack alone (docs/scaling.md): httpcore scans its whole connection list on every
request event, so its pool stays small and every scrape dialled and closed a connection.
A scrape needs one thing from HTTP: GET a URL, read at most ``body_cap`` bytes of a 2xx
body. This module does only that, in two layers (STYLE 1):

``ResponseParser`` (sans-IO, no trio): bytes in, one response out. RFC 9112 framing, as
h11 (httpx's parser) reads it:
  * head: status line ``HTTP/1.x SP 3DIGIT [SP reason]`` and header fields, lines ending in
    CRLF or LF, a head of at most HEAD_MAX bytes; 1xx interim responses are skipped;
  * body: none for 204 and 304; ``Transfer-Encoding: chunked`` (the only transfer coding
    accepted, as in h11; it wins over a Content-Length); else ``Content-Length`` (repeated
    values must agree); else the body runs to the end of the connection;
  * ``Content-Encoding: gzip`` / ``deflate`` are decoded (the request asks for identity;
    a server that compresses anyway is read like httpx reads it); other codings are kept.
The body cap counts decoded bytes: a Content-Length over the cap fails before any body
byte is read, and a chunked, read-to-close or compressed body fails as soon as the decoded
bytes pass the cap, so nothing past it is ever buffered (DESIGN 5b).

``ScrapeClient`` (the trio shell): one idle connection list per origin (scheme, host,
port), reused while it has been idle at most ``keepalive_expiry_s`` (30 s: longer than
httpx's 5 s, so that scrape intervals and passes up to 30 s keep their connections; a
provider that closes idle connections sooner costs one retry, below; it is far below the
idle timeouts of NATs and firewalls, which drop a connection silently), up to ``max_idle``
idle connections in all (each is a file descriptor; half the soft RLIMIT_NOFILE, at most
4096). It has no limit of its own on concurrent requests: the scrape pool's
CapacityLimiter is the one queue (STYLE 8).
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
import ssl
import zlib
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import unquote, urlsplit

import trio

__all__ = [
    "BodyCapExceeded",
    "ProtocolError",
    "ResponseParser",
    "ScrapeClient",
    "UndecodableBody",
    "is_tls_error",
]

HEAD_MAX = 64 * 1024
"""Most bytes a response head (status line and header fields) may take."""
REQUESTS_CACHED = 8192
"""Targets whose request bytes are kept built (more than any operator's providers)."""
CHUNK_LINE_MAX = 4096
"""Most bytes a chunk-size line (hex size plus extensions) or a trailer block may take."""
RECEIVE_BYTES = 64 * 1024
"""Bytes asked of the socket per read (each read allocates this much first: larger buffers
would come from mmap); a 75 KB exposition arrives in two or three reads."""

_END_OF_HEAD = re.compile(rb"\n\r?\n")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*(.*?)[ \t]*")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?")
_DIGITS = re.compile(rb"[0-9]{1,19}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class ProtocolError(Exception):
    """The bytes are not an HTTP/1.1 response, or it ended before it was complete."""


class BodyCapExceeded(Exception):
    """The decoded body passed the cap; nothing past it was kept."""


class UndecodableBody(Exception):
    """A gzip or deflate body that does not decompress."""


class _Decoder:
    """gzip or deflate, decoded at most ``room + 1`` bytes at a time, so a small compressed
    body cannot expand past the cap in memory."""

    def __init__(self, coding: bytes) -> None:
        self._gzip = coding in (b"gzip", b"x-gzip")
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 16) if self._gzip else None
        self._pending = b""

    def decode(self, data: bytes, room: int) -> bytes:
        if self._inflate is None:
            # "deflate" means zlib-wrapped, but some servers send a raw deflate stream (httpx
            # reads both): a valid zlib header (RFC 1950: CM 8, check bits) decides, once two
            # bytes are in.
            self._pending += data
            if len(self._pending) < 2:
                return b""
            data, self._pending = self._pending, b""
            wrapped = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        try:
            return self._inflate.decompress(data, room + 1)
        except zlib.error as exc:
            raise UndecodableBody(str(exc)) from None


class ResponseParser:
    """One HTTP/1.1 response to a GET, fed as it arrives (``receive_data``, then
    ``receive_eof`` when the peer closes). After a call, ``status`` is set once the head is
    in, and ``done`` once the whole response is; then ``body()`` is the decoded body and
    ``reusable`` says whether the connection may carry another request. Raises
    ProtocolError, BodyCapExceeded or UndecodableBody; a parser that raised is finished."""

    def __init__(self, body_cap: int) -> None:
        self.body_cap = body_cap
        self.status: int | None = None
        self.done = False
        self.reusable = False
        self.received_any = False
        self._buf = bytearray()
        self._parts: list[bytes] = []
        self._size = 0
        self._decoder: _Decoder | None = None
        self._keep_alive = False
        # "head" -> "length" | "chunk_size" | "chunk_data" | "chunk_end" | "trailers" | "close"
        self._state = "head"
        self._remaining = 0

    def body(self) -> bytes:
        return b"".join(self._parts)

    def receive_data(self, data: bytes | bytearray) -> None:
        if not data:
            return
        if self.done:
            # Bytes after a complete response: the connection is not in a known state.
            self.reusable = False
            return
        self.received_any = True
        self._buf += data
        self._advance()

    def receive_eof(self) -> None:
        if self.done:
            return
        if self._state == "close":
            self._finish(reusable=False)
            return
        if self._state == "head":
            raise ProtocolError(
                "connection closed before a complete response head"
                if self._buf or self.status is not None
                else "connection closed without a response"
            )
        if self._state == "length":
            raise ProtocolError(f"connection closed with {self._remaining} body bytes still expected")
        raise ProtocolError("connection closed inside a chunked body")

    # -- framing ---------------------------------------------------------------------------

    def _advance(self) -> None:
        buf = self._buf
        while not self.done:
            state = self._state
            if state == "head":
                if not self._head():
                    return
            elif state == "length":
                if not self._take_remaining():
                    return
                self._finish(reusable=self._keep_alive)
            elif state == "close":
                if buf:
                    self._append(bytes(buf))
                    buf.clear()
                return
            elif state == "chunk_size":
                line = self._line(CHUNK_LINE_MAX, "chunk-size line")
                if line is None:
                    return
                m = _CHUNK_SIZE.fullmatch(line)
                if m is None:
                    raise ProtocolError(f"malformed chunk-size line {bytes(line[:40])!r}")
                self._remaining = int(m.group(1), 16)
                self._state = "chunk_data" if self._remaining else "trailers"
            elif state == "chunk_data":
                if not self._take_remaining():
                    return
                self._state = "chunk_end"
            elif state == "chunk_end":
                line = self._line(2, "chunk end")
                if line is None:
                    return
                if line:
                    raise ProtocolError("chunk data longer than its chunk-size")
                self._state = "chunk_size"
            else:  # trailers: field lines up to an empty one, read and dropped
                end = _END_OF_HEAD.search(b"\n" + buf)
                if end is None:
                    if len(buf) > CHUNK_LINE_MAX:
                        raise ProtocolError(f"chunked trailers over {CHUNK_LINE_MAX} bytes")
                    return
                del buf[: end.end() - 1]
                self._finish(reusable=self._keep_alive)

    def _take_remaining(self) -> bool:
        """Move up to ``_remaining`` buffered bytes into the body; True once none remain."""
        buf = self._buf
        take = min(self._remaining, len(buf))
        if take:
            self._append(bytes(buf[:take]))
            del buf[:take]
            self._remaining -= take
        return not self._remaining

    def _line(self, limit: int, what: str) -> bytes | None:
        """The next line without its CRLF or LF ending, or None until it is complete."""
        buf = self._buf
        end = buf.find(b"\n", 0, limit + 2)
        if end < 0:
            if len(buf) > limit + 1:
                raise ProtocolError(f"{what} over {limit} bytes")
            return None
        line = bytes(buf[: end - 1] if end and buf[end - 1] == 0x0D else buf[:end])
        del buf[: end + 1]
        return line

    def _head(self) -> bool:
        buf = self._buf
        # A head may open with blank lines (RFC 9112 2.2: a recipient should ignore them).
        while buf[:1] == b"\n" or buf[:2] == b"\r\n":
            del buf[: 1 if buf[:1] == b"\n" else 2]
        end = _END_OF_HEAD.search(buf, 0, HEAD_MAX + 4)
        if end is None:
            if len(buf) > HEAD_MAX:
                raise ProtocolError(f"response head over {HEAD_MAX} bytes")
            return False
        lines = bytes(buf[: end.start()]).split(b"\n")
        del buf[: end.end()]
        status_line = lines[0].removesuffix(b"\r")
        m = _STATUS_LINE.fullmatch(status_line)
        if m is None:
            raise ProtocolError(f"malformed status line {status_line[:60]!r}")
        minor, status = m.group(1), int(m.group(2))
        fields: dict[bytes, list[bytes]] = {}
        last: list[bytes] | None = None
        for raw in lines[1:]:
            line = raw.removesuffix(b"\r")
            if line[:1] in (b" ", b"\t") and last is not None:
                # obs-fold: a continuation line joins the previous field's value (as h11 does).
                last[-1] = last[-1] + b" " + line.strip(b" \t")
                continue
            field = _FIELD.fullmatch(line)
            if field is None:
                raise ProtocolError(f"malformed header line {line[:60]!r}")
            last = fields.setdefault(field.group(1).lower(), [])
            last.append(field.group(2))
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolError("101 Switching Protocols to a plain GET")
            return True  # interim response: the real head follows
        self.status = status
        connection = {
            token.strip().lower() for value in fields.get(b"connection", ()) for token in value.split(b",")
        }
        self._keep_alive = minor == b"1" and b"close" not in connection
        coding = b",".join(fields.get(b"content-encoding", ())).strip().lower()
        if coding in (b"gzip", b"x-gzip", b"deflate"):
            self._decoder = _Decoder(coding)
        if not 200 <= status < 300:
            # The caller stops at the status; the body is never read.
            self._finish(reusable=False)
        elif status in (204, 304):
            self._finish(reusable=self._keep_alive)
        elif b"transfer-encoding" in fields:
            codings = b",".join(fields[b"transfer-encoding"]).strip().lower()
            if codings != b"chunked":
                raise ProtocolError(f"unsupported Transfer-Encoding {codings[:40]!r} (only chunked)")
            self._state = "chunk_size"
        elif b"content-length" in fields:
            values = {v.strip() for value in fields[b"content-length"] for v in value.split(b",")}
            if len(values) != 1 or _DIGITS.fullmatch(next(iter(values))) is None:
                raise ProtocolError(f"malformed Content-Length {b', '.join(sorted(values))[:60]!r}")
            self._remaining = int(next(iter(values)))
            if self._decoder is None and self._remaining > self.body_cap:
                raise BodyCapExceeded(f"Content-Length {self._remaining}")
            self._state = "length"
        else:
            self._state = "close"  # no framing: the body runs to the end of the connection
            self._keep_alive = False
        return True

    def _append(self, data: bytes) -> None:
        if self._decoder is not None:
            data = self._decoder.decode(data, self.body_cap - self._size)
        self._size += len(data)
        if self._size > self.body_cap:
            raise BodyCapExceeded(f"body over {self.body_cap} bytes")
        if data:
            self._parts.append(data)

    def _finish(self, *, reusable: bool) -> None:
        self.done = True
        # Extra bytes after the response: the connection is out of step; do not reuse it.
        self.reusable = reusable and not self._buf


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


class _Connection:
    __slots__ = ("stream", "origin", "idle_since")

    def __init__(self, stream: trio.abc.Stream, origin: Origin) -> None:
        self.stream = stream
        self.origin = origin
        self.idle_since = 0.0


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
                await trio.aclose_forcefully(connection.stream)

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
            stream = connection.stream
            try:
                await stream.send_all(request)
                while not parser.done:
                    data = await stream.receive_some(RECEIVE_BYTES)
                    if data:
                        parser.receive_data(data)
                    else:
                        parser.receive_eof()
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
                await trio.aclose_forcefully(connection.stream)

    async def _checkout(self, origin: Origin) -> _Connection | None:
        connections = self._idle.get(origin)
        now = trio.current_time()
        while connections:
            connection = connections.pop()
            self._idle_count -= 1
            if now - connection.idle_since <= self.keepalive_expiry_s:
                return connection
            # Idle too long: the server may close it any moment (uvicorn after 5 s).
            await trio.aclose_forcefully(connection.stream)
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
            stream = tls
        return _Connection(stream, origin)

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
