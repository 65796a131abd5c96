"""The plain request of the h11 backend, parsed without h11: a strict subset that h11 reads the
same way, handed on as h11 would hand it on; every other request goes to h11 unchanged.

A keep-alive client's request (an OpenAI call through the front, a scrape) is almost always
"plain": the whole head already read, an HTTP/1.1 request line, headers of visible ASCII, one
Host, no Transfer-Encoding, Expect, Upgrade or ``Connection: close``, at most one plain
Content-Length. For those, h11's head parsing, header normalization and per-event state machine
(about 20 us a request, a tenth of the front's CPU per request) are replaced by one regex pass
and a counter of body bytes. Anything else, byte for byte as it arrived, goes to an
h11.Connection, as before. tests/test_httpserver.py checks, over a grid of heads and bodies,
that what this accepts h11 parses to the same request and body, and that what h11 rejects this
declines.
"""

from __future__ import annotations

import re

import h11

__all__ = ["HEAD_END", "PlainRequest", "PlainRequestConnection", "RequestConnection", "parse_plain_request"]

_REQUEST_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+) ([\x21-\x7e]+) HTTP/1\.1")
# name ":" OWS value OWS, the value visible ASCII with inner spaces or tabs (h11's grammar
# without obs-text, which this leaves to h11). Every repeat is possessive: blanks and visible
# characters are disjoint classes, so a line splits one way only, and giving characters back
# could never find another match; with plain repeats a line of blanks ending in a control
# character was tried at every split, quadratic in the line (16 K blanks: 0.5 s of CPU).
_HEADER = re.compile(rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):[ \t]*+"
                     rb"((?:[\x21-\x7e]++(?:[ \t]++[\x21-\x7e]++)*+)?)[ \t]*+")
_DIGITS = re.compile(rb"[0-9]{1,20}")
HEAD_END = b"\r\n\r\n"
# Headers that make a request not plain: h11 reads them for framing, protocol switches,
# 100-continue or keep-alive.
_NOT_PLAIN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_END_OF_MESSAGE = h11.EndOfMessage()


class PlainRequest:
    """The fields of h11.Request the server reads; ``headers`` with lowercased names."""

    __slots__ = ("method", "target", "http_version", "headers")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.method = method
        self.target = target
        self.http_version = b"1.1"
        self.headers = headers


def parse_plain_request(data: bytes) -> tuple[PlainRequest, int, int] | None:
    """(request, bytes of its head, Content-Length) if ``data`` starts with a whole plain
    request head, else None (the caller gives ``data`` to h11)."""
    end = data.find(HEAD_END)
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    line = _REQUEST_LINE.fullmatch(lines[0])
    if line is None:
        return None
    method = line[1]
    if method == b"CONNECT":
        return None
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    hosts = 0
    for raw in lines[1:]:
        field = _HEADER.fullmatch(raw)
        if field is None:
            return None
        name = field[1].lower()
        value = field[2]
        if name == b"content-length":
            if length >= 0 or not _DIGITS.fullmatch(value):
                return None
            length = int(value)
        elif name == b"host":
            hosts += 1
        elif name == b"connection":
            if value.lower() != b"keep-alive":
                return None
        elif name in _NOT_PLAIN:
            return None
        headers.append((name, value))
    if hosts != 1:
        return None
    return PlainRequest(method, line[2], headers), end + 4, max(length, 0)


class PlainRequestConnection:
    """What the server uses of an h11.Connection, for one plain request whose head is read:
    its body of ``length`` bytes as h11.Data events and then h11.EndOfMessage, the bytes
    after it (pipelined), and error answers, which go through an h11.Connection fed the same
    head (so they are h11's bytes)."""

    __slots__ = ("head", "remaining", "buffer", "closed", "their_state", "max_incomplete", "_h11")

    they_are_waiting_for_100_continue = False

    def __init__(self, head: bytes, length: int, rest: bytes, max_incomplete_event_size: int) -> None:
        self.head = head
        self.remaining = length
        self.buffer = rest
        self.closed = False
        self.their_state: type = h11.SEND_BODY
        self.max_incomplete = max_incomplete_event_size
        self._h11: h11.Connection | None = None

    def receive_data(self, data: bytes) -> None:
        if data:
            self.buffer += data
        else:
            self.closed = True

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        if self.their_state is not h11.SEND_BODY:
            return h11.PAUSED  # h11's answer once the request is complete and ours is not
        if self.remaining == 0:
            self.their_state = h11.DONE
            return _END_OF_MESSAGE
        buffer = self.buffer
        if buffer:
            take = min(len(buffer), self.remaining)
            self.remaining -= take
            self.buffer = buffer[take:]
            return h11.Data(data=buffer[:take] if take < len(buffer) else buffer)
        if self.closed:
            self.their_state = h11.ERROR
            raise h11.RemoteProtocolError("peer closed connection without sending complete message body")
        return h11.NEED_DATA

    @property
    def trailing_data(self) -> tuple[bytes, bool]:
        return self.buffer, self.closed

    @property
    def our_state(self) -> type:
        return h11.SEND_RESPONSE if self._h11 is None else self._h11.our_state

    def send(self, event: h11.Event) -> bytes:
        """An error answer (the app's response is written by h1_response)."""
        if self._h11 is None:
            self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_incomplete)
            self._h11.receive_data(self.head)
            self._h11.next_event()  # the same request, so that the answer is framed for it
        return self._h11.send(event) or b""


RequestConnection = h11.Connection | PlainRequestConnection
"""What reads one request of a connection: h11, or this module for a plain request."""
