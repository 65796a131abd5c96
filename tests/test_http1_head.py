"""The scrape parser's head reading (gridd.operator.http1_parser) against the plain one it
replaced, on generated heads.

The parser reads a complete head where it lies in the bytes it was given (not through its
buffer) and reads the common field lines (no CR but the one ending them) with one regular
expression, each field only if present. The reference here is the head reading before
that, line by line (ReferenceParser._read_head, kept verbatim); both must answer alike:
status, body, reusable, or the same error with the same text, for heads of every shape
(obs-fold, blank lines leading, LF or CR LF or stray CRs, blanks around values, repeated
and comma-separated fields, malformed lines), whole and split anywhere.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from gridd.operator.http1_parser import (
    _DIGITS,
    _STATUS_LINE,
    BodyCapExceeded,
    ProtocolError,
    ResponseParser,
    UndecodableBody,
    _Decoder,
    _header_fields,
    _header_fields_by_line,
)

CAP = 64
# The field-line expression the parser read every line with before.
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*(.*?)[ \t]*")


class ReferenceParser(ResponseParser):
    """The parser with the head reading it had before (line by line, every field read)."""

    __slots__ = ()

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\n")
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
            return
        self.status = status
        connection = {
            token.strip().lower() for value in fields.get(b"connection", ()) for token in value.split(b",")
        }
        self._keep_alive = minor == b"1" and b"close" not in connection
        coding = b",".join(fields.get(b"content-encoding", ())).strip().lower()
        if coding in (b"gzip", b"x-gzip", b"deflate"):
            self._decoder = _Decoder(coding)
        if not 200 <= status < 300:
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
            self._state = "close"
            self._keep_alive = False


def outcome(parser: ResponseParser, pieces: Iterable[bytes]) -> tuple[object, ...]:
    try:
        for piece in pieces:
            parser.receive_data(piece)
        if not parser.done:
            parser.receive_eof()
    except (ProtocolError, BodyCapExceeded, UndecodableBody) as exc:
        return type(exc).__name__, str(exc)
    return parser.status, parser.body(), parser.reusable


ENDS = st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r\r\n"])
BLANKS = st.text(" \t", max_size=2).map(str.encode)
NAMES = st.sampled_from([
    b"content-length", b"Content-Length", b"transfer-encoding", b"Transfer-Encoding", b"connection",
    b"Connection", b"content-encoding", b"content-type", b"x-a", b"Date", b"bad name", b"", b"x:y",
])
VALUES = st.one_of(
    st.sampled_from([
        b"0", b"3", b"5", b"12", b"3, 3", b"3,4", b"-1", b"99999999999999999999", b"chunked", b"Chunked",
        b"gzip", b"chunked, gzip", b"close", b"keep-alive, Close", b"keep-alive", b"identity",
        b"text/plain; version=0.0.4", b"", b"a\rb", b"a\r", b"\x0b3",
    ]),
    st.binary(max_size=6).filter(lambda v: b"\n" not in v),
)


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """A response head with its blank line: a status line, field lines (some folded or
    malformed), each line ended in any of the ways the parser reads."""
    leading = draw(st.lists(st.sampled_from([b"\r\n", b"\n"]), max_size=2))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2"]))
    status = draw(st.sampled_from([b"200", b"200", b"204", b"304", b"100", b"101", b"404", b"2000"]))
    reason = draw(st.sampled_from([b" OK", b"", b" ", b" Odd\tReason"]))
    lines = [version + b" " + status + reason]
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.sampled_from([b" ", b"\t"])) + draw(VALUES))  # obs-fold
        else:
            lines.append(draw(NAMES) + b":" + draw(BLANKS) + draw(VALUES) + draw(BLANKS))
    head = b"".join(leading) + b"".join(line + draw(ENDS) for line in lines)
    return head + draw(st.sampled_from([b"\r\n", b"\n"]))


@settings(max_examples=1500, deadline=None)
@given(heads(), st.binary(max_size=20), st.data())
def test_a_head_is_read_as_the_line_by_line_reading_read_it_whole_and_split(head, body, data):
    raw = head + body
    expected = outcome(ReferenceParser(CAP), [raw])
    assert outcome(ResponseParser(CAP), [raw]) == expected
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=4)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert outcome(ResponseParser(CAP), pieces) == expected
    assert outcome(ReferenceParser(CAP), pieces) == expected


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(NAMES, BLANKS, VALUES, BLANKS, ENDS), max_size=5), st.data())
def test_field_lines_read_at_once_as_line_by_line(fields, data):
    lines = [name + b":" + before + value + after + end for name, before, value, after, end in fields]
    if lines and data.draw(st.booleans()):
        lines.insert(data.draw(st.integers(0, len(lines))), b" folded\r\n")
    block = b"".join(lines).removesuffix(b"\n")

    def read(reader: Callable[[bytes], dict[bytes, list[bytes]]]) -> object:
        try:
            return reader(block)
        except ProtocolError as exc:
            return str(exc)

    assert read(_header_fields) == read(_header_fields_by_line)


def test_the_common_head_is_read_without_the_line_by_line_reading(monkeypatch):
    # The fast reading is the one taken for the heads providers send.
    def by_line(block: bytes) -> dict[bytes, list[bytes]]:
        raise AssertionError("read line by line")

    monkeypatch.setattr("gridd.operator.http1_parser._header_fields_by_line", by_line)
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: 3\r\n\r\nabc"
    assert outcome(ResponseParser(CAP), [raw]) == (200, b"abc", True)


def test_blanks_inside_a_value_cost_time_in_proportion_to_the_line():
    # The expression the parser used before retried every split of a run of blanks: a head
    # of 64 KiB could cost seconds of CPU. Both readings are now linear in the line.
    for line in (b"a:" + b" " * 30_000 + b"x\ry", b"a: x" + b" " * 30_000 + b"y"):
        for block in (line, line + b"\r\n folded"):
            started = time.process_time()
            fields = _header_fields(block)
            assert time.process_time() - started < 0.5
            assert fields[b"a"][0] == line.partition(b":")[2].strip(b" \t") + (
                b" folded" if block != line else b"")
