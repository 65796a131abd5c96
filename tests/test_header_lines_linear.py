"""Header field lines are read in time linear in their length, on both HTTP paths that read
fields with a regex of their own: the gateway front's plain request reader
(gridd/http/h1_request.py) and the forwarding client's response parser
(gridd/gateway/upstream_parser.py). The scrape client's parser has its own test
(tests/test_http1_head.py).

The expressions used plain repeats around the blanks of a value; a line of blanks ending in a
character the grammar refuses was tried at every split of the run, quadratic in the line: a
16 KiB head (the front's bound) cost about 0.5 s of CPU per request. They are possessive now,
which reads the same lines (the reference expressions below are the ones used before).
"""

from __future__ import annotations

import re
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from gridd.gateway import upstream_parser
from gridd.gateway.upstream_parser import MalformedResponse, ResponseParser
from gridd.http import h1_request

# The expressions as they were (plain repeats): the reference for what a line means.
OLD_REQUEST_HEADER = re.compile(
    rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):[ \t]*((?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?)[ \t]*")
OLD_RESPONSE_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*"
                                rb"((?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?)[ \t]*")

# Short lines over the characters that decide a split: blanks, visible, a control character,
# obs-text, the colon.
LINES = st.binary(max_size=24).map(lambda raw: bytes(b" \ta:\x01\x80x-"[b % 8] for b in raw))


def groups(match: re.Match[bytes] | None) -> tuple[bytes | None, ...] | None:
    return None if match is None else match.groups()


@settings(max_examples=2000, deadline=None)
@given(LINES)
def test_the_possessive_expressions_read_every_line_as_the_plain_ones_did(line: bytes) -> None:
    assert groups(h1_request._HEADER.fullmatch(line)) == groups(OLD_REQUEST_HEADER.fullmatch(line))
    assert groups(upstream_parser._FIELD.fullmatch(line)) == groups(OLD_RESPONSE_FIELD.fullmatch(line))


BLANKS = 15_000  # within both 16 KiB head bounds


def hostile_lines() -> list[bytes]:
    return [b"x:" + b" " * BLANKS + b"\x01", b"x: a" + b"\t" * BLANKS + b"\x01",
            b"x:" + b" " * (BLANKS // 2) + b"a" + b" " * (BLANKS // 2)]


def test_a_request_head_with_a_long_run_of_blanks_is_read_at_once() -> None:
    for line in hostile_lines():
        head = b"GET / HTTP/1.1\r\nhost: a\r\n" + line + b"\r\n\r\n"
        started = time.process_time()
        parsed = h1_request.parse_plain_request(head)
        assert time.process_time() - started < 0.05  # the plain expression: about 0.5 s
        if line.endswith(b"\x01"):
            assert parsed is None  # not plain: left to h11, which refuses it
        else:
            assert parsed is not None and dict(parsed[0].headers)[b"x"] == b"a"


def test_a_response_head_with_a_long_run_of_blanks_is_read_at_once() -> None:
    for line in hostile_lines():
        parser = ResponseParser()
        started = time.process_time()
        try:
            parser.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n" + line + b"\r\n\r\n")
        except MalformedResponse as exc:
            assert line.endswith(b"\x01") and "header" in str(exc).lower()
        else:
            assert not line.endswith(b"\x01")
            assert (b"x", b"a") in parser.headers and parser.done
        assert time.process_time() - started < 0.05
