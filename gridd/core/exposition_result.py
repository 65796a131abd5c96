"""What a parse of a Prometheus exposition returns (Exposition, with its histogram bucket runs
as BucketRun), and what one target's parses keep for the next (SeriesCache, _Shape).

gridd.core.exposition parses; its docstring describes the fast paths these serve.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BucketRun", "Exposition", "SeriesCache"]

Labels = dict[str, str]
Series = list[tuple[Labels, float]]


class BucketRun:
    """Consecutive bucket lines of one histogram series, as the parse keeps them: they differ
    only in ``le``, the last label. ``labels``: the series' labels (its ``le`` is any one of
    the run's); ``les`` and ``values``: each bucket's ``le`` text and count, in order."""

    __slots__ = ("labels", "les", "values")

    def __init__(self, labels: Labels, les: list[str], values: list[float]) -> None:
        self.labels = labels
        self.les = les
        self.values = values

    def samples(self) -> Series:
        """The buckets as samples, each owning its labels dict."""
        out: Series = []
        for le, value in zip(self.les, self.values, strict=True):
            labels = self.labels.copy()
            labels["le"] = le
            out.append((labels, value))
        return out


Entry = tuple[Labels, float] | BucketRun
# A cached series: its name, its labels (shared by every sample parsed from it: read-only)
# and the length of its line up to the opening quote of its last label value (a run's start).
CachedSeries = tuple[str, Labels, int]


class SeriesCache:
    """A target's kept series from its latest scrape (as Prometheus' scrape loop keeps them):
    a canonical kept line's text before its value -> its name and labels. Passed to every
    parse of the target (same ``wanted``), it spares a repeated line the split and the
    labels dict; its samples share the cached dict, so readers must not mutate labels.
    Bounded: a parse keeps only the series it saw, at most ``limit`` of them. ``shape``: the
    latest parse's _Shape, when its lines all repeated the parse before's (else None)."""

    __slots__ = ("limit", "wanted", "series", "shape")

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        # The `wanted` the series were kept under (what a kept name means).
        self.wanted: object = None
        self.series: dict[str, CachedSeries] = {}
        self.shape: _Shape | None = None


class Exposition:
    """What parse_exposition read: ``samples`` (kept name -> list of (labels dict, value), in
    input order) and ``malformed_lines``.

    The parse keeps a histogram's bucket runs (BucketRun) without a labels dict per bucket;
    ``samples`` and ``series(name)`` write them out as samples on first use, ``entries(name)``
    reads a name's samples and bucket runs as they are (what the latency window does).

    ``layout``: the _Shape the parse read it through (the steady-state fast path), else None.
    Two expositions with the same ``layout`` object hold the same names, with the same labels
    in the same order; only their values may differ. A reader may keep what it computed from
    labels alone (which series belong to which pool or endpoint) for as long as the layout
    object it saw comes back.
    """

    __slots__ = ("malformed_lines", "layout", "_entries", "_with_buckets")

    def __init__(self) -> None:
        self.malformed_lines = 0
        self.layout: object | None = None
        self._entries: dict[str, list[Entry]] = {}
        # The names whose entries hold a BucketRun, not yet written out as samples.
        self._with_buckets: set[str] = set()

    def names(self) -> Iterable[str]:
        """The names with samples, in order of first appearance."""
        return self._entries.keys()

    def entries(self, name: str) -> list[Entry]:
        """One name's samples and bucket runs, in input order; empty when it has none."""
        return self._entries.get(name, [])

    def series(self, name: str) -> Series:
        """One name's samples; empty when it has none."""
        if name in self._with_buckets:
            self._with_buckets.discard(name)
            entries = self._entries[name]
            written: Series = []
            for entry in entries:
                if isinstance(entry, BucketRun):
                    written.extend(entry.samples())
                else:
                    written.append(entry)
            entries[:] = written
        return self._entries.get(name, [])  # type: ignore[return-value]  # samples only now

    @property
    def samples(self) -> dict[str, Series]:
        for name in list(self._with_buckets):
            self.series(name)
        return self._entries  # type: ignore[return-value]  # samples only now

# Where a line's value goes: (labels, line index, -1, None) for a sample, (labels, first line,
# stop, les) for a bucket run over lines first..stop-1.
Placement = tuple[Labels, int, int, list[str] | None]


# slice(n, None) for n below _SHARED_CUTS, shared by every target's shape (memory).
_SHARED_CUTS = 1024
_CUTS = [slice(n, None) for n in range(_SHARED_CUTS)]


def _cut(n: int) -> slice:
    return _CUTS[n] if n < _SHARED_CUTS else slice(n, None)


class _Shape:
    """A parse whose every line went through a fast path into one sample, with each line's text
    up to its value and the blank before it (``prefixes``) and where each value went. A body
    whose picked lines have those prefixes and plain value tokens parses to the same samples
    and bucket runs with its own values (_shape_of has why), built here in C-level steps."""

    __slots__ = ("prefixes", "cuts", "names")

    def __init__(self, prefixes: list[str], names: list[tuple[str, list[Placement]]]) -> None:
        self.prefixes = prefixes
        self.cuts = [_cut(len(prefix)) for prefix in prefixes]
        # Per name: its placements, or, when they are samples of adjacent lines (most names),
        # their labels and the slice of lines, zipped in C.
        self.names: list[tuple[str, list[Labels] | None, slice, list[Placement]]] = []
        for name, placements in names:
            first, last = placements[0][1], placements[-1][1]
            plain = None
            if all(les is None for _, _, _, les in placements) and last - first + 1 == len(placements):
                plain = [labels for labels, _, _, _ in placements]
            self.names.append((name, plain, slice(first, last + 1), placements))

    def parse(self, lines: list[str], check_ascii: bool) -> Exposition | None:
        """``lines`` parsed, or None when they do not have this shape (the full parse decides)."""
        if len(lines) != len(self.prefixes) or not all(map(str.startswith, lines, self.prefixes)):
            return None
        tokens: list[str] = list(map(str.__getitem__, lines, self.cuts))
        joined = "".join(tokens)
        # The line loop's token checks, on every token at once; no blank: each prefix still
        # ends at its line's last blank.
        if " " in joined or "_" in joined or (check_ascii and not joined.isascii()):
            return None
        try:
            values = list(map(float, tokens))
        except ValueError:
            return None
        out = Exposition()
        out.layout = self
        for name, plain, lines_slice, placements in self.names:
            if plain is not None:
                out._entries[name] = list(zip(plain, values[lines_slice], strict=True))
                continue
            entries: list[Entry] = []
            for labels, start, stop, les in placements:
                if les is None:
                    entries.append((labels, values[start]))
                else:
                    entries.append(BucketRun(labels, les.copy(), values[start:stop]))
                    out._with_buckets.add(name)
            out._entries[name] = entries
        return out


def _shape_of(lines: list[str], out: Exposition) -> _Shape | None:
    """The _Shape of a parse in which no line reached _parse_line and none was malformed, or
    None. Every line must hold one sample, and its text after its last blank must be the
    token the fast path read: the text before ends with '"}' (the '"} ' the fast path cut
    at: a token without a blank holds no other) or is a bare name. Then a line with the same
    text up to that blank and a plain token takes the same path to the same name and labels
    (the run checks read only the text before the token, and the token checks are _Shape's)."""
    prefixes: list[str] = []
    lines_of: dict[str, list[int]] = {}
    for index, line in enumerate(lines):
        cut = line.rfind(" ")
        head = line[:cut]
        if cut < 0 or not (head.endswith('"}') or ("{" not in head and " " not in head)):
            return None
        prefixes.append(line[: cut + 1])
        lines_of.setdefault(head.partition("{")[0], []).append(index)
    if lines_of.keys() != out._entries.keys():
        return None
    names: list[tuple[str, list[Placement]]] = []
    for name, entries in out._entries.items():
        # A name's samples and runs hold its lines in input order, a run's lines adjacent.
        indices, at = lines_of[name], 0
        placements: list[Placement] = []
        for entry in entries:
            if at >= len(indices):
                return None
            if isinstance(entry, BucketRun):
                start, stop = indices[at], indices[at] + len(entry.values)
                if indices[at : at + len(entry.values)] != list(range(start, stop)):
                    return None
                placements.append((entry.labels, start, stop, entry.les))
                at += len(entry.values)
            else:
                placements.append((entry[0], indices[at], -1, None))
                start, stop, at = indices[at], indices[at] + 1, at + 1
            written = entry.values if isinstance(entry, BucketRun) else [entry[1]]
            try:
                read = [float(lines[i][len(prefixes[i]) :]) for i in range(start, stop)]
            except ValueError:
                return None
            if repr(read) != repr(written):  # the values its tokens hold (NaN equal to NaN)
                return None
        if at != len(indices):
            return None
        names.append((name, placements))
    return _Shape(prefixes, names)
