"""One app response of the h11 backend, rendered to bytes without an h11 event per message.

h11 still parses every request and writes the server's own error answers (400, 413, 431,
500, ...); the app's response is written here, byte for byte as h11.Connection.send would
write it for the same request (tests/test_httpserver.py compares the two over a grid of
requests, statuses, header sets and body shapes). h11 builds and validates an event per
message and re-validates every header on each of its rewrites: about 20 us per response,
which at the front's rate was a tenth of its CPU per request (docs/http-serving.md).

What h11 does, and so this does (h11 0.16, _connection.py and _writers.py):
- headers are validated (RFC 9110 token names, field values) and normalized (one
  Content-Length, Transfer-Encoding lowercased). The common answer (valid headers, at most
  one plain Content-Length, no Transfer-Encoding, Connection or Host, not HEAD, 204 or 304)
  is written in one pass; any other goes through ``h11.Response`` itself for validation and
  normalization, so its errors are h11's;
- framing: 204, 304 and answers to HEAD have no body; else Transfer-Encoding: chunked, else
  Content-Length, else a body of unknown length, sent chunked to an HTTP/1.1 client and
  close-delimited to an HTTP/1.0 one (``Content-Length`` removed, ``Transfer-Encoding:
  chunked`` appended);
- a connection that will not be kept alive gets ``Connection: close`` appended (the request
  asked for it or is HTTP/1.0, or the body is close-delimited);
- Host goes first, then the other headers in order; the status line has an empty reason.
"""

from __future__ import annotations

import re

import h11

__all__ = ["ResponseWriter", "request_keeps_alive"]

# h11's header grammar (h11/_abnf.py: token, field-value); a header that does not match goes
# through h11.Response, which raises its own error for it.
_FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
_DIGITS = re.compile(rb"[0-9]{1,20}")  # h11: CONTENT_LENGTH_MAX_DIGITS
# Names h11 rewrites or moves (besides Content-Length): such an answer takes the long way.
_REWRITTEN = frozenset({b"transfer-encoding", b"connection", b"host"})
# Header names already found valid: an app sends the same few names on every answer.
_valid_names: set[bytes] = set()
_VALID_NAMES_MAX = 1024


def _valid_name(raw: bytes) -> bool:
    if raw in _valid_names:
        return True
    if not _FIELD_NAME.fullmatch(raw):
        return False
    if len(_valid_names) < _VALID_NAMES_MAX:
        _valid_names.add(raw)
    return True


# How the body is framed: chunks, a declared length, or until the connection closes.
_CHUNKED, _LENGTH, _UNTIL_CLOSE = 0, 1, 2


def _comma_tokens(headers: list[tuple[bytes, bytes, bytes]], name: bytes) -> list[bytes]:
    """h11's get_comma_header: the lowercased, stripped, non-empty comma-separated values."""
    out: list[bytes] = []
    for _, found, value in headers:
        if found == name:
            out.extend(token for token in (part.strip() for part in value.lower().split(b",")) if token)
    return out


def request_keeps_alive(http_version: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether h11 keeps the connection open after this request's exchange, as far as the
    request says (h11's _keep_alive: HTTP/1.1 and no ``Connection: close``); ``headers`` as
    h11 parsed them (lowercased names)."""
    if http_version < b"1.1":
        return False
    for name, value in headers:
        if name == b"connection" and b"close" in (part.strip() for part in value.lower().split(b",")):
            return False
    return True


class ResponseWriter:
    """The bytes of one response: head() once, then data() and end(). Raises
    h11.LocalProtocolError where h11 would (a bad header or status, a body that does not fit
    its Content-Length); after that every call raises."""

    __slots__ = ("method", "http_version", "keep_alive", "_framing", "_remaining", "_failed")

    def __init__(self, method: bytes, http_version: bytes, request_keep_alive: bool) -> None:
        self.method = method
        self.http_version = http_version
        self.keep_alive = request_keep_alive
        """After end(): whether the connection may carry another request."""
        self._framing = _LENGTH
        self._remaining = 0
        self._failed = False

    def _check(self) -> None:
        if self._failed:
            raise h11.LocalProtocolError("Can't send data when our state is ERROR")

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        self._check()
        method = self.method
        if (type(status) is int and 200 <= status < 1000 and status != 204 and status != 304
                and method != b"HEAD" and method != b"CONNECT"):
            out = self._plain_head(status, headers)
            if out is not None:
                return out
        return self._any_head(status, headers)

    def _plain_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The common answer, in one pass: valid headers, none of Transfer-Encoding,
        Connection or Host, at most one plain Content-Length. None: take _any_head."""
        parts = [b"HTTP/1.1 %d \r\n" % status]
        length = -1
        for raw, value in headers:
            name = raw.lower()
            if name == b"content-length":
                if length >= 0 or not _DIGITS.fullmatch(value):
                    return None
                length = int(value)
            elif name in _REWRITTEN or not _FIELD_VALUE.fullmatch(value) or not _valid_name(raw):
                return None
            parts.append(b"%s: %s\r\n" % (raw, value))
        if length >= 0:
            self._framing, self._remaining = _LENGTH, length
        elif self.http_version >= b"1.1":
            self._framing = _CHUNKED
            parts.append(b"Transfer-Encoding: chunked\r\n")
        else:
            return None
        if not self.keep_alive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _any_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """Any answer: h11's steps one by one (the module's docstring)."""
        items = self._normalized(status, headers)
        method = self.method
        chosen = b"GET" if method == b"HEAD" else method
        framing, _ = self._framing_of(chosen, status, items)
        need_close = False
        if framing != _LENGTH:
            items = [item for item in items if item[1] != b"content-length"]
            items = [item for item in items if item[1] != b"transfer-encoding"]
            if self.http_version < b"1.1":
                need_close = method != b"HEAD"
            else:
                items.append((b"Transfer-Encoding", b"transfer-encoding", b"chunked"))
        if not self.keep_alive or need_close:
            connection = set(_comma_tokens(items, b"connection"))
            connection.discard(b"keep-alive")
            connection.add(b"close")
            items = [item for item in items if item[1] != b"connection"]
            items.extend((b"Connection", b"connection", token) for token in sorted(connection))
        if b"close" in _comma_tokens(items, b"connection"):
            self.keep_alive = False
        # The body is framed as the final headers say, for the request's real method.
        self._framing, self._remaining = self._framing_of(method, status, items)
        if self._framing == _UNTIL_CLOSE:
            self.keep_alive = False
        if method == b"CONNECT" and 200 <= status < 300:
            # h11 hands the connection over to another protocol here, which gridd never
            # speaks: the head goes out, and any body message after it is an error.
            self._failed = True
        parts = [b"HTTP/1.1 %d \r\n" % status]
        parts.extend(b"%s: %s\r\n" % (raw, value) for raw, name, value in items if name == b"host")
        parts.extend(b"%s: %s\r\n" % (raw, value) for raw, name, value in items if name != b"host")
        parts.append(b"\r\n")
        return b"".join(parts)

    def data(self, body: bytes) -> bytes:
        self._check()
        if self._framing == _LENGTH:
            self._remaining -= len(body)
            if self._remaining < 0:
                self._failed = True
                raise h11.LocalProtocolError("Too much data for declared Content-Length")
            return body
        if self._framing == _CHUNKED:
            # An empty chunk would read as the end of the body.
            return b"%x\r\n%s\r\n" % (len(body), body) if body else b""
        return body

    def end(self) -> bytes:
        self._check()
        if self._framing == _LENGTH:
            if self._remaining != 0:
                self._failed = True
                raise h11.LocalProtocolError("Too little data for declared Content-Length")
            return b""
        return b"0\r\n\r\n" if self._framing == _CHUNKED else b""

    @staticmethod
    def _normalized(status: int, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes, bytes]]:
        """(raw name, lowercased name, value) as h11.Response holds them: h11's own validation
        and normalization, and its errors (this path is for the answers _plain_head declines)."""
        event = h11.Response(status_code=status, headers=headers)
        return [(raw, raw.lower(), value) for raw, value in event.headers.raw_items()]

    @staticmethod
    def _framing_of(method: bytes, status: int, items: list[tuple[bytes, bytes, bytes]]) -> tuple[int, int]:
        """h11's _body_framing for a response to ``method``."""
        if status in (204, 304) or method == b"HEAD" or (method == b"CONNECT" and 200 <= status < 300):
            return _LENGTH, 0
        if _comma_tokens(items, b"transfer-encoding"):
            return _CHUNKED, 0
        lengths = _comma_tokens(items, b"content-length")
        if lengths:
            return _LENGTH, int(lengths[0])
        return _UNTIL_CLOSE, 0
