"""Probe extraction and sliding-window aggregation (spec 004). Pure: no trio, no IO.

extract(body, rules) -> {name: value}
    regex rule: matched against the whole body (``finditer``); per match the LAST capture
        group is the value and the group before it the name, so one pattern names and
        reads many series (one per matching line). A match whose name group is empty or
        did not take part, or whose value is not a finite decimal number, is skipped.
    json rule: a dotted path into the body parsed once as JSON; a segment indexes a list
        when it is a decimal integer. The name is the path's last segment; the value must
        be a JSON number (true/false are not numbers: skipped, as are strings such as "7",
        null, objects and lists). A body that is not JSON yields nothing for json rules.
    Values must be finite: NaN and +/-Inf are skipped, because receivers reject a batch
        carrying a non-finite probe value (gridd.core.payload.validate_payload).
    A name produced more than once (two matching lines, or two rules) takes the LAST value
        produced, rules in order, matches in body order.

Catastrophic backtracking. Python's ``re`` has no time limit and holds the GIL (a worker
thread would not keep the event loop responsive), so the guard is on the input and the
pattern shape: the body is at most the operator's body cap (1 MiB by default, cut by
fetch_capped before it gets here), and a pattern with a variable-length repeat inside an
unbounded one, such as ``(a+)+``, ``(\\w+_)*`` or ``(a{1,3})+`` -- the shape whose matching
time grows exponentially -- is refused (``regex_hazard``). Possessive quantifiers (``*+``,
``++``) and atomic groups (``(?>...)``) never backtrack and are accepted inside repeats.
Polynomial shapes remain possible (``\\{[^}]*\\}`` scans to the end of a body that lacks
the closing brace, once per candidate start); docs/probes.md advises ``[^}\\n]*``.

SlidingAggregate(window, method): the last ``window`` samples of one series (the window
counts samples, not seconds: DESIGN 5b) reduced by one method; see METHODS.

ProbeSeries: one probe's windows, one per series name, at most ``max_series`` of them.
"""

from __future__ import annotations

import functools
import math
import re

# The parser behind re.compile: the hazard check walks the parsed pattern. No public module
# exposes it (sre_parse, its old name, warns as deprecated since 3.11) and typeshed has no
# stubs for these names, so mypy sees them as Any.
import re._constants as _sre_constants  # type: ignore[import-not-found]  # private, no stubs (above)
import re._parser as _sre_parser  # type: ignore[import-not-found]  # private, no stubs (above)
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import regex

__all__ = ["METHODS", "ExtractRuleFields", "Extractor", "Observation", "ProbeSeries", "SlidingAggregate",
           "extract", "parse_number", "regex_hazard"]

METHODS = ("latest", "mean", "median", "p50", "p90", "p95", "p99", "ewma", "min", "max", "stdev")
_PERCENTILES = {"median": 0.5, "p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}

# A decimal float literal: what a Prometheus gauge or counter prints, minus NaN/Inf. Python's
# float() alone would also take "1_000", " 7 ", "infinity" and non-ASCII digits.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def parse_number(text: str | None) -> float | None:
    """The finite float a regex value group holds, or None (non-numeric: skipped)."""
    if text is None or _NUMBER.fullmatch(text) is None:
        return None
    value = float(text)
    return value if math.isfinite(value) else None


# -- the pattern-shape guard ------------------------------------------------------------------

_REPEATS = (_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT)
_NO_BACKTRACK = tuple(op for op in (getattr(_sre_constants, "POSSESSIVE_REPEAT", None),
                                    getattr(_sre_constants, "ATOMIC_GROUP", None)) if op is not None)


def _children(av: Any) -> Iterable[Any]:
    """The sub-patterns inside one parsed item's argument, whatever its opcode."""
    if isinstance(av, _sre_parser.SubPattern):
        yield av
    elif isinstance(av, list | tuple):
        for item in av:
            yield from _children(item)


def _nested_repeat(items: Any, inside_unbounded: bool) -> bool:
    """A repeat of variable length (low < high) inside an unbounded repeat: the outer one can
    split a run of input among its iterations in exponentially many ways, and tries them all
    when the rest of the pattern fails. A bounded outer repeat costs at most a polynomial."""
    for op, av in items:
        if op in _NO_BACKTRACK:
            continue  # matched once, never re-entered by backtracking
        if op in _REPEATS:
            low, high, body = av
            if inside_unbounded and low < high:
                return True
            if _nested_repeat(body, inside_unbounded or high == _sre_constants.MAXREPEAT):
                return True
            continue
        if any(_nested_repeat(sub, inside_unbounded) for sub in _children(av)):
            return True
    return False


@functools.lru_cache(maxsize=512)
def regex_hazard(pattern: str) -> str | None:
    """Why ``pattern`` may backtrack catastrophically, or None. The test is the nested
    quantifier shape (``_nested_repeat``): ``(a+)+``, ``(?:\\w+_)*``, ``(a{1,3})+``. It is a
    heuristic: ambiguous alternation under a repeat, ``(a|a)+``, is not detected."""
    try:
        parsed = _sre_parser.parse(pattern)
    except re.error as exc:
        return f"invalid regular expression: {exc}"
    if _nested_repeat(parsed, False):
        return ("a variable-length repeat inside an unbounded one can backtrack catastrophically; make "
                "the inner one possessive (a++) or atomic ((?>...)), or bound the outer one")
    return None


EXTRACT_BUDGET_S = 0.25
"""Matching time one tick may spend on all its regex rules together. Patterns that are slow in
the square of the body (``(\\w+)\\s+(\\d+)`` on one long word) pass any static check; the
``regex`` engine's per-call timeout bounds them, so a hostile body costs a failed tick, never
the event loop. The stdlib ``re`` has no such bound (measured: 591 s on 256 KiB)."""


class ExtractTimeout(Exception):
    """The tick's regex budget ran out: the tick fails as ``extract_timeout``."""


@functools.lru_cache(maxsize=512)
def _compile(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


# -- extraction ---------------------------------------------------------------------------------


def _json_leaf(tree: Any, segments: Sequence[str]) -> float | None:
    node = tree
    for segment in segments:
        if isinstance(node, dict):
            if segment not in node:
                return None
            node = node[segment]
        elif isinstance(node, list) and segment.isdecimal() and segment.isascii():
            index = int(segment)
            if index >= len(node):
                return None
            node = node[index]
        else:
            return None
    # bool is a subclass of int in Python; JSON true/false are not numbers.
    if isinstance(node, bool) or not isinstance(node, int | float):
        return None
    try:
        value = float(node)
    except OverflowError:  # an integer beyond float range
        return None
    return value if math.isfinite(value) else None


class ExtractRuleFields(Protocol):
    """What extraction reads of one extract rule: exactly one of ``regex`` and ``json`` is set.
    The config's ``ExtractRule`` has this shape; the core takes the plain values and never
    imports the config (the config validates by calling the core, not the other way round)."""

    @property
    def regex(self) -> str | None: ...

    @property
    def json(self) -> str | None: ...


class Extractor:
    """One probe's extract rules, compiled once (per probe start, i.e. per config).

    ``refused``: (rule index, reason) for regex rules refused by ``regex_hazard``; the other
    rules still run."""

    __slots__ = ("_steps", "refused")

    def __init__(self, rules: Sequence[ExtractRuleFields]) -> None:
        self._steps: list[tuple[regex.Pattern[str] | None, tuple[str, ...]]] = []
        self.refused: list[tuple[int, str]] = []
        for index, rule in enumerate(rules):
            if rule.regex is not None:
                hazard = regex_hazard(rule.regex)
                if hazard is not None:
                    self.refused.append((index, hazard))
                    continue
                pattern = _compile(rule.regex)
                if pattern.groups < 2:
                    self.refused.append((index, "expected two capture groups (name, then value)"))
                    continue
                self._steps.append((pattern, ()))
            elif rule.json is not None:
                self._steps.append((None, tuple(rule.json.split("."))))

    def extract(self, body: bytes | str, *, budget_s: float = EXTRACT_BUDGET_S) -> dict[str, float]:
        """Raises ExtractTimeout when the regex rules together need more than ``budget_s``."""
        values: dict[str, float] = {}
        text: str | None = None
        tree: Any = None
        parsed = False
        deadline = time.perf_counter() + budget_s
        for pattern, segments in self._steps:
            if pattern is not None:
                if text is None:
                    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
                name_group = pattern.groups - 1
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise ExtractTimeout(f"regex rules took more than {budget_s:g} s")
                try:
                    for match in pattern.finditer(text, timeout=remaining):
                        name = match.group(name_group)
                        value = parse_number(match.group(pattern.groups))
                        if name and value is not None:
                            values[name] = value
                except TimeoutError:
                    raise ExtractTimeout(f"regex {pattern.pattern!r} took more than {budget_s:g} s") from None
                continue
            if not parsed:
                parsed = True
                try:
                    tree = msgspec.json.decode(body)
                except (msgspec.DecodeError, RecursionError):
                    tree = None
            if tree is not None:
                value = _json_leaf(tree, segments)
                if value is not None and segments[-1]:
                    values[segments[-1]] = value
        return values


@functools.lru_cache(maxsize=256)
def _extractor_for(rules: tuple[ExtractRuleFields, ...]) -> Extractor:
    return Extractor(rules)


def extract(body: bytes | str, rules: Sequence[ExtractRuleFields]) -> dict[str, float]:
    """``{name: value}`` from one body (module docstring). Rules compile once per rule set."""
    return _extractor_for(tuple(rules)).extract(body)


# -- aggregation ---------------------------------------------------------------------------------


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, Hyndman-Fan type 7):
    rank h = q * (n - 1); p50 of an even count is the mean of the middle two."""
    h = q * (len(ordered) - 1)
    low = math.floor(h)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (h - low) * (ordered[high] - ordered[low])


class SlidingAggregate:
    """The last ``window`` samples of one series, reduced by ``method``:

    latest      the newest sample
    mean        arithmetic mean (math.fsum)
    median/p50  the 0.5 quantile; p90, p95, p99 likewise (``_quantile``: linear, type 7)
    ewma        exponentially weighted moving average, alpha = 2 / (window + 1) (the EWMA
                whose centre of mass matches a ``window``-sample mean). Seeded with the first
                sample, then s = alpha * x + (1 - alpha) * s for every later sample: it runs
                over every sample since the probe (re)started, the window only sets alpha
    min, max    over the window
    stdev       sample standard deviation (n - 1 denominator); 0.0 for a single sample
    """

    __slots__ = ("window", "method", "samples", "alpha", "_ewma")

    def __init__(self, window: int, method: str) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 sample, got {window}")
        if method not in METHODS:
            raise ValueError(f"unknown aggregate method {method!r}")
        self.window = window
        self.method = method
        self.samples: deque[float] = deque(maxlen=window)
        self.alpha = 2.0 / (window + 1)
        self._ewma: float | None = None

    def add(self, value: float) -> None:
        self.samples.append(value)
        ewma = value if self._ewma is None else self.alpha * value + (1 - self.alpha) * self._ewma
        # Near the float limit the product can overflow; start over from this sample rather
        # than hold an infinity forever.
        self._ewma = ewma if math.isfinite(ewma) else value

    def value(self) -> float | None:
        """The aggregate, or None before the first sample or when it is not finite (values
        near the float limit can overflow a sum; receivers reject non-finite values)."""
        if not self.samples:
            return None
        try:
            result = self._reduce()
        except OverflowError:  # math.fsum and ** raise instead of returning inf
            return None
        return result if math.isfinite(result) else None

    def _reduce(self) -> float:
        samples, method = self.samples, self.method
        if method == "latest":
            result = samples[-1]
        elif method == "mean":
            result = math.fsum(samples) / len(samples)
        elif method in _PERCENTILES:
            result = _quantile(sorted(samples), _PERCENTILES[method])
        elif method == "ewma":
            assert self._ewma is not None
            result = self._ewma
        elif method == "min":
            result = min(samples)
        elif method == "max":
            result = max(samples)
        else:  # stdev
            n = len(samples)
            if n == 1:
                result = 0.0
            else:
                mean = math.fsum(samples) / n
                result = math.sqrt(math.fsum((x - mean) ** 2 for x in samples) / (n - 1))
        return result


class Observation(msgspec.Struct, frozen=True):
    """One successful tick: every held series' aggregate, and how many extracted names were
    dropped because the probe already held ``max_series`` series."""

    aggregates: dict[str, float]
    dropped: int = 0


class ProbeSeries:
    """One probe's series. Only successful ticks reach ``observe``: a failed tick leaves every
    window as it was (spec: the window keeps its last good values until the next successful
    tick). A successful tick is the probe's current view, so a series it no longer extracts
    is forgotten (its window, and through the metadata sink its published value) and frees
    its slot.

    The cardinality cap (``max_series``): a series already held is always kept; a new name
    is admitted, in extraction order, only while fewer than ``max_series`` are held; the rest
    are dropped and counted, every tick they appear."""

    __slots__ = ("window", "method", "max_series", "windows")

    def __init__(self, *, window: int, method: str, max_series: int) -> None:
        SlidingAggregate(window, method)  # validates both up front
        self.window = window
        self.method = method
        self.max_series = max_series
        self.windows: dict[str, SlidingAggregate] = {}

    def __len__(self) -> int:
        return len(self.windows)

    def observe(self, values: Mapping[str, float]) -> Observation:
        for name in [n for n in self.windows if n not in values]:
            del self.windows[name]
        dropped = 0
        for name, value in values.items():
            window = self.windows.get(name)
            if window is None:
                if len(self.windows) >= self.max_series:
                    dropped += 1
                    continue
                window = self.windows[name] = SlidingAggregate(self.window, self.method)
            window.add(value)
        aggregates = {name: v for name, w in self.windows.items() if (v := w.value()) is not None}
        return Observation(aggregates, dropped)
