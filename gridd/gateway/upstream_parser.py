"""One upstream HTTP/1.1 response, read sans-IO: bytes in, a head and de-framed body bytes out.

The forwarding client (upstream_client) feeds what each socket read brought; the parser
keeps no trio and no socket, so every framing and every split of the bytes is tested apart
(tests/test_upstream_client.py, hypothesis splits). RFC 9112 framing, as h11 (the parser
under httpx, which the front used before) reads a response:

* head: status line ``HTTP/1.x SP 3DIGIT [SP reason]`` and header fields (obs-fold lines
  join the previous value), lines ending in CRLF or LF; at most HEAD_MAX bytes (h11's bound,
  so the same heads pass); 1xx interim responses are skipped, 101 is refused (the front
  never asks for an upgrade);
* body: none for 204 and 304; ``Transfer-Encoding: chunked`` (the only coding accepted, as in
  h11; it wins over a Content-Length; chunk extensions and trailers are read and dropped);
  else ``Content-Length`` (repeated values must agree); else the body runs to the end of the
  connection (never reused).

The body is not decoded: the front relays it byte for byte (Content-Encoding passes).
The scrape client's parser (gridd/operator/http1.py) reads the same framing for a GET with
a body cap and decoding; this one streams a body of any size out as it arrives.
"""

from __future__ import annotations

import re

__all__ = ["CHUNK_LINE_MAX", "HEAD_MAX", "MalformedResponse", "ResponseParser"]

HEAD_MAX = 16 * 1024
"""Most bytes a response head may take: h11's max_incomplete_event_size, the front's bound
through httpx."""
CHUNK_LINE_MAX = 4096
"""Most bytes a chunk-size line (hex size plus extensions) or a trailer section may take."""

_END_OF_HEAD = re.compile(rb"\n\r?\n")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?")
# h11's field grammar: a token, ":", optional whitespace, visible characters with inner
# spaces or tabs, optional whitespace. Possessive repeats (one split of a line is possible:
# blanks and visible characters are disjoint), so a line that does not match fails in time
# linear in its length; plain repeats tried every split of a run of blanks (quadratic).
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*+"
                    rb"((?:[\x21-\x7e\x80-\xff]++(?:[ \t]++[\x21-\x7e\x80-\xff]++)*+)?)[ \t]*+")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?")
_DIGITS = re.compile(rb"[0-9]{1,19}")

# Parser states.
_HEAD, _LENGTH, _CHUNK_SIZE_LINE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _TO_CLOSE, _DONE = range(8)


class MalformedResponse(Exception):
    """The bytes are not an HTTP/1.1 response, or the connection ended before it was whole."""


class ResponseParser:
    """One response, fed as it arrives: ``feed(data)`` per read, ``feed_eof()`` when the peer
    closed. After a call, ``status`` is non-zero once the final head is in (``headers``: its
    fields, names lowercased, in order), ``take_body()`` hands out the body bytes parsed so
    far, and ``done`` says the response is complete; then ``reusable`` says whether the
    connection may carry another request (keep-alive, nothing after the response). Raises
    MalformedResponse; body bytes parsed before the fault stay takeable."""

    __slots__ = ("status", "headers", "done", "reusable", "_keep_alive", "_buf", "_state", "_remaining",
                 "_body")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.done = False
        self.reusable = False
        self._keep_alive = False
        self._buf = b""
        self._state = _HEAD
        self._remaining = 0
        self._body: list[bytes] = []

    def take_body(self) -> bytes:
        """The body bytes parsed since the last call (b"" when none), in one piece."""
        body = self._body
        if not body:
            return b""
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return data

    def feed(self, data: bytes) -> None:
        if self._state == _DONE:
            if data:
                self.reusable = False  # bytes after a complete response: out of step
            return
        buf = self._buf + data if self._buf else data
        if self._state == _LENGTH and not self._buf:
            # The common case: a Content-Length body arriving (the parse loop, minus its work).
            remaining = self._remaining
            if len(buf) < remaining:
                self._body.append(buf)
                self._remaining = remaining - len(buf)
                return
        self._buf = b""
        pos = self._parse(buf)
        if pos < len(buf):
            if self._state == _DONE:
                self.reusable = False
            else:
                self._buf = buf[pos:]

    def feed_eof(self) -> None:
        state = self._state
        if state == _DONE:
            return
        if state == _TO_CLOSE:
            self._finish(reusable=False)
            return
        if state == _HEAD:
            raise MalformedResponse("connection closed before a complete response head"
                                    if self._buf else "connection closed without a response")
        if state == _LENGTH:
            raise MalformedResponse(f"connection closed with {self._remaining} body bytes still expected")
        raise MalformedResponse("connection closed inside a chunked body")

    # -- framing ---------------------------------------------------------------------------

    def _parse(self, buf: bytes) -> int:
        """Parse ``buf`` from its start; the position of the first byte not consumed."""
        pos = 0
        end = len(buf)
        body = self._body
        while pos < end:
            state = self._state
            if state == _LENGTH or state == _CHUNK_DATA:
                take = min(self._remaining, end - pos)
                body.append(buf[pos:pos + take] if pos or take < end else buf)
                pos += take
                self._remaining -= take
                if self._remaining:
                    return pos
                if state == _LENGTH:
                    self._finish(reusable=self._keep_alive)
                else:
                    self._state = _CHUNK_END
            elif state == _CHUNK_SIZE_LINE:
                newline = buf.find(b"\n", pos, pos + CHUNK_LINE_MAX + 2)
                if newline < 0:
                    if end - pos > CHUNK_LINE_MAX + 1:
                        raise MalformedResponse(f"chunk-size line over {CHUNK_LINE_MAX} bytes")
                    return pos
                stop = newline - 1 if newline > pos and buf[newline - 1] == 0x0D else newline
                line = buf[pos:stop]
                size = _CHUNK_SIZE.fullmatch(line)
                if size is None:
                    raise MalformedResponse(f"malformed chunk-size line {line[:40]!r}")
                pos = newline + 1
                self._remaining = int(size.group(1), 16)
                self._state = _CHUNK_DATA if self._remaining else _TRAILERS
            elif state == _CHUNK_END:
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                elif buf.startswith(b"\n", pos):
                    pos += 1
                elif buf.startswith(b"\r", pos) and pos + 1 == end:
                    return pos  # the LF is still to come
                else:
                    raise MalformedResponse("chunk data longer than its chunk-size")
                self._state = _CHUNK_SIZE_LINE
            elif state == _TRAILERS:
                if buf.startswith(b"\r\n", pos) or buf.startswith(b"\n", pos):
                    pos += 1 if buf[pos] == 0x0A else 2
                    self._finish(reusable=self._keep_alive)
                    continue
                if buf.startswith(b"\r", pos) and pos + 1 == end:
                    return pos
                blank = _END_OF_HEAD.search(buf, pos, pos + CHUNK_LINE_MAX + 3)
                if blank is None:
                    if end - pos > CHUNK_LINE_MAX + 2:
                        raise MalformedResponse(f"chunked trailers over {CHUNK_LINE_MAX} bytes")
                    return pos
                pos = blank.end()  # trailer fields are dropped, as the relay has no use for them
                self._finish(reusable=self._keep_alive)
            elif state == _HEAD:
                pos = self._head(buf, pos)
                if pos < 0:
                    return -pos - 1
            elif state == _TO_CLOSE:
                body.append(buf[pos:] if pos else buf)
                return end
            else:  # _DONE
                return pos
        return pos

    def _head(self, buf: bytes, pos: int) -> int:
        """Parse a head starting at ``pos``: the position after it, or ``-(pos + 1)`` while
        it is incomplete."""
        blank = _END_OF_HEAD.search(buf, pos)
        if blank is None:
            if len(buf) - pos > HEAD_MAX + 2:
                raise MalformedResponse(f"response head over {HEAD_MAX} bytes")
            return -(pos + 1)
        if blank.start() - pos > HEAD_MAX:
            raise MalformedResponse(f"response head over {HEAD_MAX} bytes")
        lines = buf[pos:blank.start()].split(b"\n")
        after = blank.end()
        status_line = lines[0].removesuffix(b"\r")
        status = _STATUS_LINE.fullmatch(status_line)
        if status is None:
            raise MalformedResponse(f"malformed status line {status_line[:60]!r}")
        code = int(status.group(2))
        headers: list[tuple[bytes, bytes]] = []
        for raw in lines[1:]:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if line[:1] in (b" ", b"\t") and headers:
                # obs-fold: a continuation line joins the previous field's value (as h11 does).
                name, value = headers[-1]
                headers[-1] = (name, value + b" " + line.strip(b" \t"))
                continue
            field = _FIELD.fullmatch(line)
            if field is None:
                raise MalformedResponse(f"malformed header line {line[:60]!r}")
            headers.append((field.group(1).lower(), field.group(2)))
        if code < 200:
            if code == 101:
                raise MalformedResponse("101 Switching Protocols, and no upgrade was asked for")
            return after  # interim response: the final head follows
        self.status = code
        self.headers = headers
        self._framing(status.group(1) == b"1", code, headers)
        return after

    def _framing(self, http11: bool, code: int, headers: list[tuple[bytes, bytes]]) -> None:
        keep_alive = http11
        chunked = False
        length: bytes | None = None
        for name, value in headers:
            if name == b"connection":
                if keep_alive and b"close" in (token.strip().lower() for token in value.split(b",")):
                    keep_alive = False
            elif name == b"transfer-encoding":
                if chunked:
                    raise MalformedResponse("more than one Transfer-Encoding field")
                if value.lower() != b"chunked":
                    raise MalformedResponse(f"unsupported Transfer-Encoding {value[:40]!r} (only chunked)")
                chunked = True
            elif name == b"content-length":
                for part in value.split(b","):
                    part = part.strip()
                    if _DIGITS.fullmatch(part) is None or (length is not None and part != length):
                        raise MalformedResponse(f"malformed Content-Length {value[:60]!r}")
                    length = part
        self._keep_alive = keep_alive
        if code in (204, 304):
            self._finish(reusable=keep_alive)
        elif chunked:
            self._state = _CHUNK_SIZE_LINE
        elif length is not None:
            self._remaining = int(length)
            if self._remaining:
                self._state = _LENGTH
            else:
                self._finish(reusable=keep_alive)
        else:
            self._state = _TO_CLOSE  # no framing: the body runs to the end of the connection

    def _finish(self, *, reusable: bool) -> None:
        self._state = _DONE
        self.done = True
        self.reusable = reusable
