"""The scrape client's HTTP/1.1 response parser (sans-IO, no trio: STYLE 1): bytes in, one
response to a GET out; the trio shell around it is gridd.operator.http1.

RFC 9112 framing, as h11 (httpx's parser) reads it:
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
"""

from __future__ import annotations

import re
import zlib

__all__ = ["HEAD_MAX", "BodyCapExceeded", "ProtocolError", "ResponseParser", "UndecodableBody"]

HEAD_MAX = 64 * 1024
"""Most bytes a response head (status line and header fields) may take."""
CHUNK_LINE_MAX = 4096
"""Most bytes a chunk-size line (hex size plus extensions) or a trailer block may take."""

_END_OF_HEAD = re.compile(rb"\n\r?\n")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A field line (name ":" value, the value without the blanks around it) when it has no CR
# but the one that may end it: the name, and the value with the blanks that end it (which
# _header_fields strips). Any other line is the third group, so that matches follow each
# other line by line. Possessive (*+): a line that is not such a field line fails at once,
# never retried with fewer blanks before its value (quadratic in the blanks otherwise); a
# field line matches on the first try, so the groups are those of plain greedy repeats.
_FIELD_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*+([^\r\n]*+)\r?\n|([^\n]*\n)")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?")
_DIGITS = re.compile(rb"[0-9]{1,19}")


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


def _header_fields(block: bytes) -> dict[bytes, list[bytes]]:
    """The header fields of a head's lines after the status line (``block``, its lines
    separated by LF, each possibly ending in CR): lowercased name -> values in order."""
    fields: dict[bytes, list[bytes]] = {}
    for name, value, other in _FIELD_LINE.findall(block + b"\n"):
        if other:
            # Not a common field line (obs-fold, malformed, a CR inside): line by line.
            return _header_fields_by_line(block)
        fields.setdefault(name.lower(), []).append(value.rstrip(b" \t"))
    return fields


def _header_fields_by_line(block: bytes) -> dict[bytes, list[bytes]]:
    """_header_fields for any block: each line by _FIELD, obs-fold joined."""
    fields: dict[bytes, list[bytes]] = {}
    last: list[bytes] | None = None
    for raw in block.split(b"\n"):
        line = raw.removesuffix(b"\r")
        if line[:1] in (b" ", b"\t") and last is not None:
            # obs-fold: a continuation line joins the previous field's value (as h11 does).
            last[-1] = last[-1] + b" " + line.strip(b" \t")
            continue
        # name ":" value: a token up to the first colon, the value less the blanks around it
        # (h11's field-value; str.strip, not a regex that retries every split of the blanks).
        name, colon, value = line.partition(b":")
        if not colon or _FIELD_NAME.fullmatch(name) is None:
            raise ProtocolError(f"malformed header line {line[:60]!r}")
        last = fields.setdefault(name.lower(), [])
        last.append(value.strip(b" \t"))
    return fields


class ResponseParser:
    """One HTTP/1.1 response to a GET, fed as it arrives (``receive_data``, then
    ``receive_eof`` when the peer closes). After a call, ``status`` is set once the head is
    in, and ``done`` once the whole response is; then ``body()`` is the decoded body and
    ``reusable`` says whether the connection may carry another request. Raises
    ProtocolError, BodyCapExceeded or UndecodableBody; a parser that raised is finished."""

    __slots__ = ("body_cap", "status", "done", "reusable", "received_any", "_buf", "_parts", "_size",
                 "_decoder", "_keep_alive", "_state", "_remaining")

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

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the connection. A view (of the client's read buffer) may
        be reused once this returns: whatever the parser keeps, it copies."""
        if not data:
            return
        if self.done:
            # Bytes after a complete response: the connection is not in a known state.
            self.reusable = False
            return
        self.received_any = True
        # Fast paths while nothing is buffered, for the common response (a head, then a
        # Content-Length body): each complete head is read where it lies, and body bytes go
        # straight into the body, one copy each (a read of a whole 75 KB response makes one
        # allocation of its size: the body). The bytes are split only where the framing is
        # already known, which any split of the input must parse the same (tests: every
        # byte split).
        while self._state == "head" and not self._buf:
            end = _END_OF_HEAD.search(data, 0, HEAD_MAX + 4)
            if end is None or end.end() == len(data):
                break
            cut = end.end()
            if data[0] in b"\r\n":
                # Blank lines may lead: _head drops them, then looks for the end anew.
                self._buf += data[:cut]
                data = data[cut:]
                self._advance()
            else:
                # What _head would read: the head is all before the end found, and nothing
                # is left buffered. Its framing then runs on the rest of ``data`` below
                # (or by _advance), as _advance would run it on an empty buffer.
                head = bytes(data[: end.start()])
                data = data[cut:]
                self._read_head(head)
            if self.done:
                self.reusable = False  # bytes after a complete response
                return
        if self._state == "length" and not self._buf and self._decoder is None:
            take = min(self._remaining, len(data))
            self._append(data if take == len(data) and isinstance(data, bytes) else bytes(data[:take]))
            self._remaining -= take
            if take < len(data):
                self._buf += data[take:]
            if not self._remaining:
                self._finish(reusable=self._keep_alive)
            return
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
            if take == len(buf):
                self._append(bytes(buf))
                buf.clear()
            else:
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
        head = bytes(buf[: end.start()])
        del buf[: end.end()]
        self._read_head(head)
        return True

    def _read_head(self, head: bytes) -> None:
        """Read one head (its lines, less the blank line that ends it) and set up the body's
        framing; an interim (1xx) head leaves the parser waiting for the next head."""
        status_line, newline, block = head.partition(b"\n")
        status_line = status_line.removesuffix(b"\r")
        m = _STATUS_LINE.fullmatch(status_line)
        if m is None:
            raise ProtocolError(f"malformed status line {status_line[:60]!r}")
        minor, status = m.group(1), int(m.group(2))
        fields = _header_fields(block) if newline else {}
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolError("101 Switching Protocols to a plain GET")
            return  # interim response: the real head follows
        self.status = status
        # Each field read only if present: an absent one reads as the empty list would.
        connection = fields.get(b"connection")
        self._keep_alive = minor == b"1" and (
            connection is None
            or b"close" not in {token.strip().lower() for value in connection for token in value.split(b",")}
        )
        encoding = fields.get(b"content-encoding")
        if encoding is not None:
            coding = b",".join(encoding).strip().lower()
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
        elif (lengths := fields.get(b"content-length")) is not None:
            # One field of one value (no comma) is the set of its value alone.
            values = ({lengths[0].strip()} if len(lengths) == 1 and b"," not in lengths[0]
                      else {v.strip() for value in lengths for v in value.split(b",")})
            if len(values) != 1 or _DIGITS.fullmatch(length := next(iter(values))) is None:
                raise ProtocolError(f"malformed Content-Length {b', '.join(sorted(values))[:60]!r}")
            self._remaining = int(length)
            if self._decoder is None and self._remaining > self.body_cap:
                raise BodyCapExceeded(f"Content-Length {self._remaining}")
            self._state = "length"
        else:
            self._state = "close"  # no framing: the body runs to the end of the connection
            self._keep_alive = False

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
