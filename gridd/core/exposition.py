"""Prometheus text exposition (format 0.0.4) parser for EPP and vLLM /metrics bodies.

parse_exposition(body, wanted, cache, max_lines=None) -> Exposition
    body: the raw /metrics body (bytes, UTF-8) or str.
    wanted: sample names to keep exactly as they appear on sample lines
        (e.g. "llm_d_epp_request_ttft_seconds_bucket"); None keeps every sample.
    cache: the target's SeriesCache, passed to each parse of its bodies (below), or None.
    max_lines: raise TooManyLines, before any line is read one by one, for a body holding more
        newlines than this; not counted for a body read through the cache's _Shape (at most
        as many lines read as the target's previous scrape had picked; the operator's
        MAX_EXPOSITION_LINES has why that keeps the bound). None: no limit.
    Exposition.samples: sample name -> list of (labels dict, value float), in input order.
    Exposition.malformed_lines: lines that could not be parsed (skipped, never fatal).
    Exposition.series(name): one name's samples; Exposition.entries(name): the same with a
        histogram series' bucket lines still as one BucketRun (what the latency window reads).

The grammar, modelled on client_golang's text parser (`_parse_line` implements it):

    line   = blanks name (blanks "{" labels "}" | blank) space* value [blank+ timestamp] space*
    labels = blanks [pair *("," blanks pair) ["," blanks]]
    pair   = label-name blanks "=" blanks '"' label-value '"' blanks

Blanks are spaces and tabs; `space` is any whitespace, so CRLF endings and trailing
blanks are fine. A label value holds anything but a raw '"', '\\' or newline, plus the
escapes \\\\, \\" and \\n (any other escape is malformed); label names may not repeat.
The value is a float literal as Go writes it (1, 0.25, 1.5e+06, NaN, +Inf, -Inf) and
as Python's float() reads it, minus '_' separators and non-ASCII digits. The timestamp
is an integer, checked and dropped. Blank lines and lines whose first non-blank is '#'
(HELP, TYPE, comments) are ignored. Lines end at '\\n' only: U+0085, U+2028 and the
other Unicode line breaks are ordinary characters inside label values.

Malformed lines are counted and skipped, with one exception that keeps filtering cheap:
with `wanted`, a line that starts with a valid metric name not in `wanted` is skipped
without looking further, so it is never counted, whatever follows the name. A body that
is not valid UTF-8 is decoded line by line, and each sample line that does not decode is
malformed (same exception); bad bytes in a comment are ignored.

Speed (this runs on every scrape of every EPP): one pass over the lines, and most lines
cost a few C-level string calls.
  * With `wanted` given as a set or frozenset (the operator's WANTED_SAMPLES), the lines
    are not split out one by one: one compiled regex (`_scan`) picks, in C, the lines whose
    leading name is wanted and the lines that start with neither a name character nor '#'.
    Every line it leaves out is a comment or starts with an unwanted name, which the loop
    below skips uncounted anyway, so the result is the same (malformed counts included;
    tests/test_exposition.py checks it against a list of the same names, which visits
    every line). On an EPP body that is about a quarter of the lines.
  * The text before the first "{" (or " ") is looked up in a per-body dict that says
    whether the name is kept, so a name is validated and matched against `wanted` once.
  * Runs. After an unwanted line the rest of its family is skipped with one prefix
    compare per line. After a kept line in canonical form (below), the next lines that
    repeat it up to the opening quote of the last label value copy its label dict and
    replace that one value. When that last label is "le" (a histogram series' buckets,
    which client libraries write last), no dict is built per line: the run becomes one
    BucketRun (the series' labels, and each bucket's le text and count), written out as
    samples only when `samples` or `series` is read. The latency window reads the runs
    and checks a series' labels once, not once per bucket.
  * Canonical form is what client_golang and prometheus_client write: no backslash,
    name{a="x",b="y"} value, no blanks inside the braces, no timestamp. With no
    backslash every '"' opens or closes a value, so split('"') yields the label-name
    layout and the values; the layout selects a compiled dict builder (_builder).
  * With a SeriesCache (one per provider), a line whose text before its value was a kept
    canonical line of the target's previous scrape costs a slice, a lookup and float().
    When every picked line repeats the previous scrape's up to its value (a target's steady
    state), the parse after the scan is a few C-level passes over the lines (_Shape in
    gridd/core/exposition_result.py, where the result types live).
Any other line goes to `_parse_line`, the authority: the fast paths only accept a line
when `_parse_line` would return the same sample (tests/test_exposition.py checks this).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container

from gridd.core.exposition_result import (
    BucketRun,
    CachedSeries,
    Entry,
    Exposition,
    Labels,
    SeriesCache,
    _shape_of,
)
from gridd.core.exposition_scan import _kept_names, _scan

__all__ = ["BucketRun", "Exposition", "SeriesCache", "TooManyLines", "parse_exposition"]

Builder = Callable[[list[str]], Labels]


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LEADING_NAME = re.compile(r"[ \t]*+([a-zA-Z_:][a-zA-Z0-9_:]*+)")

# The line grammar of the module docstring. Each blank run sits between two tokens that
# cannot be blank and is matched by one possessive quantifier, so no input backtracks:
# a hostile line costs linear time.
_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*+[ \t]*+=[ \t]*+"(?:[^"\\]++|\\[\\"n])*+"[ \t]*+'
_SAMPLE_LINE = re.compile(
    r"[ \t]*+([a-zA-Z_:][a-zA-Z0-9_:]*+)"
    r"(?:[ \t]*+\{([ \t]*+(?:" + _PAIR + r"(?:,[ \t]*+" + _PAIR + r")*+(?:,[ \t]*+)?)?)\}|[ \t])"
    r"\s*+(\S++)(?:[ \t]++(\S++))?+\s*+"
)
# One pair of a label block that _SAMPLE_LINE has already accepted.
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}
_TIMESTAMP = re.compile(r"[+-]?[0-9]+")


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(1)]


def _to_value(token: str) -> float | None:
    """A sample value token as a float, or None.

    float() alone is too lax: it takes '_' digit separators and non-ASCII digits, which
    Go's ParseFloat (producers and Prometheus) rejects. Go's hex floats are not produced
    by client_golang or prometheus_client and float() rejects them.
    """
    if "_" in token or not token.isascii():
        return None
    try:
        return float(token)
    except ValueError:
        return None


def _parse_line(line: str) -> tuple[str, Labels, float] | tuple[()] | None:
    """One line by the full grammar: (name, labels, value), () to ignore, None if malformed."""
    if not line or line.isspace() or line.lstrip(" \t")[:1] == "#":
        return ()
    m = _SAMPLE_LINE.fullmatch(line)
    if m is None:
        return None
    name, block, token, timestamp = m.groups()
    value = _to_value(token)
    if value is None or (timestamp is not None and _TIMESTAMP.fullmatch(timestamp) is None):
        return None
    labels: Labels = {}
    if block:
        for pair in _LABEL_PAIR.finditer(block):
            label, raw = pair.groups()
            if label in labels:
                return None
            labels[label] = _ESCAPE.sub(_unescape, raw) if "\\" in raw else raw
    return name, labels, value


def _label_names(layout: tuple[str, ...]) -> tuple[str, ...] | None:
    """Label names from the pieces between the values of a '"'-split label block, or None.

    `layout` is ('a=', ',b=', ',c=') for {a="..",b="..",c=".."}: the first piece must be
    exactly `name=`, the others `,name=`, the names distinct. Anything else (blanks,
    garbage, a missing comma) is not canonical.
    """
    names = tuple(piece[1 if i else 0 : -1] for i, piece in enumerate(layout))
    for i, (piece, label) in enumerate(zip(layout, names, strict=True)):
        if piece[-1:] != "=" or (i and piece[:1] != ",") or _LABEL_NAME.fullmatch(label) is None:
            return None
    return names if len(set(names)) == len(names) else None


# Label layout -> function building the labels dict from the '"'-split pieces, or False
# when the layout is not canonical. Building label dicts is most of a kept line's cost,
# and a dict display with constant keys ({"a": p[1], "b": p[3]}) builds one about 2.5x
# faster than dict(zip(names, p[1::2])), so each canonical layout gets a small compiled
# function. Layouts repeat across scrapes of a target, hence a module-level cache. It is
# bounded: once it is full, and for label sets too large to be worth compiling, a layout
# gets an uncached dict(zip(...)) closure.
_BUILDERS: dict[tuple[str, ...], Builder | bool] = {}
_BUILDERS_MAX = 2048
_COMPILED_LABELS_MAX = 64


def _builder(layout: tuple[str, ...]) -> Builder | bool:
    names = _label_names(layout)
    build: Builder | bool
    if names is None:
        build = False
    elif len(_BUILDERS) >= _BUILDERS_MAX or len(names) > _COMPILED_LABELS_MAX:
        return lambda pieces: dict(zip(names, pieces[1::2], strict=True))
    else:
        # The names match [a-zA-Z_][a-zA-Z0-9_]* and are repr()-quoted: eval sees only
        # string literals and subscripts. p[2k+1] is the k-th value; an odd piece count
        # (an unterminated quote) makes the last subscript raise IndexError.
        items = ", ".join(f"{name!r}: p[{2 * k + 1}]" for k, name in enumerate(names))
        build = eval(f"lambda p: {{{items}}}")
    if len(_BUILDERS) < _BUILDERS_MAX:
        _BUILDERS[layout] = build
    return build


class TooManyLines(ValueError):
    """A body over parse_exposition's ``max_lines``, refused before it was read line by line."""


def _refuse_over(body: bytes | str, max_lines: int | None) -> None:
    """Raise TooManyLines when ``body`` holds more than ``max_lines`` newlines, counted at memchr
    speed: bytes.replace finds a single byte with memchr where bytes.count tests byte by byte
    (4x the CPU on a 75 KB EPP body)."""
    if max_lines is None or len(body) <= max_lines:
        return  # too short to hold that many
    newlines = len(body) - len(body.replace(b"\n", b"")) if isinstance(body, bytes) else body.count("\n")
    if newlines > max_lines:
        raise TooManyLines(f"more than {max_lines} lines")


def _split_undecodable(body: bytes) -> tuple[list[str], list[str]]:
    """Lines of a body that is not valid UTF-8: (decoded lines, lines that do not decode)."""
    lines: list[str] = []
    broken: list[str] = []
    for raw in body.split(b"\n"):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            broken.append(raw.decode("utf-8", "replace"))
    return lines, broken


def parse_exposition(
    body: bytes | str,
    wanted: Container[str] | None = None,
    cache: SeriesCache | None = None,
    *,
    max_lines: int | None = None,
) -> Exposition:
    if cache is not None and cache.wanted is not wanted:
        cache.wanted, cache.series, cache.shape = wanted, {}, None
    out = Exposition()
    samples = out._entries

    def counts_as_malformed(line: str) -> bool:
        """A malformed line counts unless the filter would have skipped it (its name)."""
        if wanted is None:
            return True
        head = _LEADING_NAME.match(line)
        return head is None or head.group(1) in wanted

    malformed = 0
    scan = None
    try:
        text = body if isinstance(body, str) else body.decode("utf-8")
    except UnicodeDecodeError:
        assert isinstance(body, bytes)  # a str never fails to decode
        _refuse_over(body, max_lines)
        lines, broken = _split_undecodable(body)
        malformed = sum(1 for line in broken if line.lstrip(" \t")[:1] != "#" and counts_as_malformed(line))
        check_ascii = escapes = True
    else:
        scan = _scan(wanted) if isinstance(wanted, frozenset | set) else None
        shape = cache.shape if cache is not None and scan is not None else None
        if shape is None:
            _refuse_over(body, max_lines)
        # The lines that matter, picked in one C-level pass (_scan); an EPP body's latency
        # and load families are about a quarter of its lines.
        lines = scan.findall("\n" + text) if scan is not None else text.split("\n")
        if shape is not None:
            shaped = shape.parse(lines, not text.isascii())
            if shaped is not None:
                # The lines of the scrape before, their values new: no more lines read one by
                # one than that scrape picked, however many the body holds (max_lines).
                return shaped
            _refuse_over(body, max_lines)
        # float() reads non-ASCII digits and spaces; only a non-ASCII body can hold them
        # (str.isascii() is O(1)).
        check_ascii = not text.isascii()
        # Bodies rarely hold a backslash at all; one scan spares a check per run line.
        escapes = "\\" in text

    # The text before "{" (or before " " on a bare line) -> the list its samples go to
    # (kept), False (a valid name not wanted, or a comment: skip the line), True (not a
    # plain metric name: the line needs _parse_line).
    route: dict[str, list[Entry] | bool] = {}
    builders = _BUILDERS

    # The wanted names that are metric names: kept without another check (kept per wanted
    # set, with its scan, each mapped to the set's own object, which a _Shape keys by).
    kept_names = _kept_names(wanted) if isinstance(wanted, frozenset | set) else {}

    def classify(name: str) -> list[Entry] | bool:
        if name in kept_names:
            return samples.setdefault(name, [])
        if name[:1] == "#":
            return False
        if _METRIC_NAME.fullmatch(name) is None:
            return True
        if wanted is not None and name not in wanted:
            return False
        return samples.setdefault(name, [])

    slow_lines = 0

    def slow(line: str) -> int:
        """_parse_line and keep the sample if wanted; 1 when the line counts as malformed."""
        nonlocal slow_lines
        slow_lines += 1
        parsed = _parse_line(line)
        if parsed is None:
            return 1 if counts_as_malformed(line) else 0
        if parsed:
            name, labels, value = parsed
            dest = route.get(name)
            if dest is None:
                dest = route[name] = classify(name)
            if dest.__class__ is list:
                dest.append((labels, value))
        return 0

    # The current run (module docstring). Skipping: `run` is an unwanted name plus "{"
    # or " ". Copying: `run` is a kept canonical line up to and including the opening
    # quote of its last label value, `run_labels` that line's labels (or a later copy)
    # and `run_label` the last label's name, looked up on first use. When that label is
    # "le" (histogram buckets), the run's lines go to a BucketRun in `run_dest` instead:
    # `run_first` is the run's first sample, which becomes the BucketRun's first bucket if
    # it is still the last entry, and `run_bucket` the BucketRun the run goes on in.
    run = "\n"  # no line contains "\n": matches nothing
    run_skip = False
    run_len = 0
    run_name = ""
    run_dest: list[Entry] = []
    run_labels: Labels = {}
    run_label: str | None = None
    run_first: Entry | None = None
    run_bucket: BucketRun | None = None

    # The series cache (SeriesCache): `cached` holds the previous parse's series, `seen` the
    # ones this parse finds (hits and new canonical lines), which replace them at the end.
    cached: dict[str, CachedSeries] = {}
    seen: dict[str, CachedSeries] = {}
    seen_max = 0
    # Lines the general path parsed whole (not a cached series): a shape needs none.
    fresh = 0
    if cache is not None:
        cached, seen_max = cache.series, cache.limit

    for line in lines:
        if line[:run_len] == run:
            if run_skip:
                continue
            # The last value, up to the first '"} ', and the token after it. With no
            # '"' or '\' in that value and a plain token (float() refuses '' when
            # there is no '"} '), the line is canonical with the run's layout.
            last, _, token = line[run_len:].partition('"} ')
            if (
                '"' not in last
                and not (escapes and "\\" in last)
                and "_" not in token
                and (not check_ascii or token.isascii())
            ):
                try:
                    value = float(token)
                except ValueError:
                    pass
                else:
                    if run_label is None:
                        run_label = next(reversed(run_labels))
                    if run_label == "le":
                        if run_bucket is not None and run_dest[-1] is run_bucket:
                            run_bucket.les.append(last)
                            run_bucket.values.append(value)
                        elif run_dest[-1] is run_first:
                            # The run's first sample becomes its first bucket.
                            first_value = run_dest[-1][1]  # type: ignore[index]  # run_first, a sample
                            run_bucket = BucketRun(run_labels, [run_labels["le"], last], [first_value, value])
                            run_dest[-1] = run_bucket
                            out._with_buckets.add(run_name)
                        else:
                            # A sample of the name came in between (_parse_line took it).
                            run_bucket = BucketRun(run_labels, [last], [value])
                            run_dest.append(run_bucket)
                            out._with_buckets.add(run_name)
                        continue
                    labels = run_labels.copy()
                    labels[run_label] = last
                    run_dest.append((labels, value))
                    run_labels = labels
                    continue
            # Not the run's shape after all: the general path decides.

        if cached:
            # A series of the scrape before: line = series " " token, the token without
            # a blank. The series was a canonical line's text up to '"} ', and the line
            # is canonical again when its token is a plain float (the checks below are
            # the general path's): the same name and labels, whatever the value.
            cut = line.rfind(" ")
            series_text = line[:cut]
            hit = cached.get(series_text)
            if hit is not None:
                token = line[cut + 1 :]
                if "_" not in token and (not check_ascii or token.isascii()):
                    try:
                        value = float(token)
                    except ValueError:
                        pass
                    else:
                        name, labels, run_len = hit
                        # A kept name (classify would return this list).
                        kept = samples.get(name)
                        if kept is None:
                            kept = samples[name] = []
                        run_first = (labels, value)
                        kept.append(run_first)
                        if len(seen) < seen_max:
                            seen[series_text] = hit
                        run = line[:run_len]
                        run_skip = False
                        run_name = name
                        run_dest = kept
                        run_labels = labels
                        run_label = None
                        run_bucket = None
                        continue

        name, brace, rest = line.partition("{")
        if brace:
            dest = route.get(name)
            if dest is None:
                dest = route[name] = classify(name)
            if dest is False:
                run = name + brace
                run_len = len(run)
                run_skip = True
                continue
            # Canonical: name{a="x",b="y"} value. The last '"} ' ends the label block
            # when the token after it holds no '"', which float() checks.
            head, end, token = rest.rpartition('"} ')
            if (
                dest is True
                or not end
                or (escapes and "\\" in rest)
                or "_" in token
                or (check_ascii and not token.isascii())
            ):
                malformed += slow(line)
                continue
            pieces = head.split('"')
            layout = tuple(pieces[0::2])
            build = builders.get(layout)
            if build is None:
                build = _builder(layout)
            try:
                value = float(token)
                # TypeError: a non-canonical layout (False); IndexError: odd piece count.
                labels = build(pieces)  # type: ignore[operator]  # False raises TypeError, caught here
            except (ValueError, TypeError, IndexError):
                malformed += slow(line)
                continue
            run_first = (labels, value)
            dest.append(run_first)
            # line = name "{" head '"} ' token, and head ends with the last value.
            run_len = len(name) + 1 + len(head) - len(pieces[-1])
            fresh += 1
            if " " not in token and len(seen) < seen_max:
                # The line's series text: everything before its last blank (SeriesCache).
                seen[line[: len(line) - len(token) - 1]] = (name, labels, run_len)
            run = line[:run_len]
            run_skip = False
            run_name = name
            run_dest = dest
            run_labels = labels
            run_label = None
            run_bucket = None
            continue
        name, space, token = line.partition(" ")
        if not space:
            malformed += slow(line)
            continue
        dest = route.get(name)
        if dest is None:
            dest = route[name] = classify(name)
        if dest is False:
            run = name + space
            run_len = len(run)
            run_skip = True
            continue
        if dest is True or "_" in token or (check_ascii and not token.isascii()):
            malformed += slow(line)
            continue
        try:
            value = float(token)
        except ValueError:
            malformed += slow(line)
            continue
        dest.append(({}, value))

    out.malformed_lines = malformed
    if cache is not None:
        cache.series = seen
        # A scrape whose every line repeated a cached series (a target's steady state) and
        # went through the fast paths: the next scrape may have its shape.
        steady = scan is not None and not fresh and not slow_lines and not malformed and lines
        cache.shape = _shape_of(lines, out, kept_names) if steady and len(lines) <= 4 * cache.limit else None
    # A kept name whose every line was malformed got a list but no sample.
    for name in [name for name, series in samples.items() if not series]:
        del samples[name]
    return out
