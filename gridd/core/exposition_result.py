"""What a parse of a Prometheus exposition returns (Exposition, with its histogram bucket runs
as BucketRun), and what one target's parses keep for the next (SeriesCache, _Shape).

gridd.core.exposition parses; its docstring describes the fast paths these serve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import is_, itemgetter

__all__ = ["BucketRun", "Exposition", "SeriesCache"]

Labels = dict[str, str]
Series = list[tuple[Labels, float]]


class BucketRun:
    """Consecutive bucket lines of one histogram series, as the parse keeps them: they differ
    only in ``le``, the last label. ``labels``: the series' labels (its ``le`` is any one of
    the run's); ``les`` and ``values``: each bucket's ``le`` text and count, in order. Like the
    labels, ``les`` is read-only: a parse read through a _Shape shares one list between the
    runs with the same bounds, and with every later parse read through that shape."""

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
    object it saw comes back, and read the values alone by position: ``values(name)`` and
    ``entry_values(name)``. A parse read through a _Shape holds its lines' values only, and
    builds its samples and runs on the first call that needs them (entries, series, samples,
    names): a reader by position never has them built, nor touches a labels dict.
    """

    __slots__ = ("malformed_lines", "layout", "_entries", "_with_buckets", "_shape", "_values", "_picked")

    def __init__(self) -> None:
        self.malformed_lines = 0
        self.layout: object | None = None
        self._entries: dict[str, list[Entry]] = {}
        # The names whose entries hold a BucketRun, not yet written out as samples.
        self._with_buckets: set[str] = set()
        # A parse read through a _Shape, until its entries are built: the shape, the lines'
        # values, and those values in the order of the shape's samples (on first use).
        self._shape: _Shape | None = None
        self._values: list[float] = []
        self._picked: Sequence[float] | None = None

    def _built(self) -> dict[str, list[Entry]]:
        shape = self._shape
        if shape is not None:
            self._shape = None
            shape.build(self)
        return self._entries

    def names(self) -> Iterable[str]:
        """The names with samples, in order of first appearance."""
        return self._built().keys()

    def entries(self, name: str) -> list[Entry]:
        """One name's samples and bucket runs, in input order; empty when it has none."""
        return self._built().get(name, [])

    def series(self, name: str) -> Series:
        """One name's samples; empty when it has none."""
        entries_of = self._built()
        if name in self._with_buckets:
            self._with_buckets.discard(name)
            entries = entries_of[name]
            written: Series = []
            for entry in entries:
                if isinstance(entry, BucketRun):
                    written.extend(entry.samples())
                else:
                    written.append(entry)
            entries[:] = written
        return entries_of.get(name, [])  # type: ignore[return-value]  # samples only now

    @property
    def samples(self) -> dict[str, Series]:
        self._built()
        for name in list(self._with_buckets):
            self.series(name)
        return self._entries  # type: ignore[return-value]  # samples only now

    def values(self, name: str) -> Sequence[float]:
        """The values of ``series(name)``, in order."""
        shape = self._shape
        if shape is None:
            return [value for _, value in self.series(name)]
        where = shape.where.get(name)
        if where is None:
            return []
        if isinstance(where, slice):
            picked = self._picked
            if picked is None:
                picked = self._picked = self._values if shape.pick is None else shape.pick(self._values)
            return picked[where]
        values = self._values
        out: list[float] = []
        for _, start, stop, les in where:
            if les is None:
                out.append(values[start])
            else:
                out.extend(values[start:stop])
        return out

    def entry_values(self, name: str) -> list[float | list[float]]:
        """Per entry of ``entries(name)``: a sample's value, or a bucket run's counts (a list,
        which the caller must not change)."""
        shape = self._shape
        if shape is None:
            return [e.values if isinstance(e, BucketRun) else e[1] for e in self.entries(name)]
        where = shape.where.get(name)
        if where is None:
            return []
        if isinstance(where, slice):
            return list(self.values(name))
        values = self._values
        return [values[start] if les is None else values[start:stop] for _, start, stop, les in where]


# Where a line's value goes: (labels, line index, -1, None) for a sample, (labels, first line,
# stop, les) for a bucket run over lines first..stop-1.
Placement = tuple[Labels, int, int, list[str] | None]


class _Shape:
    """A parse whose every line went through a fast path into one sample, with each line's text
    up to its value and the blank before it (``prefixes``) and where each value went. A body
    whose picked lines have those prefixes and plain value tokens parses to the same samples
    and bucket runs with its own values (_shape_of has why), built here in C-level steps.

    The samples of the names without a bucket run are built in one zip, grouped by name (their
    labels in ``labels``, in that order; ``pick`` takes their values out of the lines' values
    in that order, None when those are the first lines) and handed out as one slice per
    name (``slices``, in ``names`` order: the parse's order of first appearance). The names
    with a bucket run (``runs``) are built from their placements."""

    __slots__ = ("prefixes", "names", "slices", "labels", "pick", "runs", "where")

    def __init__(self, prefixes: list[str], names: list[tuple[str, list[Placement]]]) -> None:
        self.prefixes = prefixes
        self.names = [name for name, _ in names]
        self.slices: list[slice] = []
        self.labels: list[Labels] = []
        self.runs: list[tuple[str, list[Placement]]] = []
        lines: list[int] = []
        # One list per distinct run of bucket bounds, the shape's own: every parse hands it out
        # (BucketRun.les is read-only), so a parse neither copies it nor touches its strings.
        bounds: dict[tuple[str, ...], list[str]] = {}

        def own(les: list[str] | None) -> list[str] | None:
            return None if les is None else bounds.setdefault(tuple(les), les[:])

        for name, placements in names:
            if any(les is not None for _, _, _, les in placements):
                placements = [(labels, start, stop, own(les)) for labels, start, stop, les in placements]
                self.runs.append((name, placements))
                self.slices.append(slice(0, 0))  # a placeholder: parse writes the name's entries
                continue
            start = len(lines)
            for labels, line, _, _ in placements:
                lines.append(line)
                self.labels.append(labels)
            self.slices.append(slice(start, len(lines)))
        # zip stops at the last label, so values in the lines' own order need no pick when
        # those samples are the first lines (all of them, usually). itemgetter of one index
        # returns the value, not a tuple: a second index (any line) keeps it a tuple.
        self.pick = None if lines == list(range(len(lines))) else itemgetter(*lines, 0)
        # Each name's slice of the samples, or its placements (a name with a run): where
        # Exposition.values and entry_values find a name's values without the samples.
        self.where: dict[str, slice | list[Placement]] = dict(zip(self.names, self.slices, strict=True))
        self.where.update(self.runs)

    def parse(self, lines: list[str], check_ascii: bool) -> Exposition | None:
        """``lines`` parsed, or None when they do not have this shape (the full parse decides)."""
        if len(lines) != len(self.prefixes):
            return None
        # Each line's token, its text after its prefix. removeprefix hands back the line itself
        # (the same object: a str from the scan, never a subclass) when it does not start with
        # its prefix; a prefix is never empty (it ends with a blank), so a line that does start
        # with it gives a shorter, new string.
        tokens: list[str] = list(map(str.removeprefix, lines, self.prefixes))
        if any(map(is_, tokens, lines)):
            return None
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
        out.layout = out._shape = self
        out._values = values
        return out

    def build(self, out: Exposition) -> None:
        """``out``'s samples and runs (a parse read through this shape), from its values."""
        values = out._values
        picked = out._picked
        if picked is None:
            picked = values if self.pick is None else self.pick(values)
        samples: list[Entry] = list(zip(self.labels, picked, strict=False))  # values may run on (__init__)
        # Each name's samples, a fresh list (Exposition.series rewrites a name's list in place).
        cut: Callable[[slice], list[Entry]] = samples.__getitem__  # the slice overload
        entries = out._entries = dict(zip(self.names, map(cut, self.slices), strict=True))
        for name, placements in self.runs:
            built: list[Entry] = []
            for labels, start, stop, les in placements:
                if les is None:
                    built.append((labels, values[start]))
                else:
                    built.append(BucketRun(labels, les, values[start:stop]))
            entries[name] = built  # its key is in place already: the order of names holds
            out._with_buckets.add(name)


def _shape_of(lines: list[str], out: Exposition, canonical: Mapping[str, str]) -> _Shape | None:
    """The _Shape of a parse in which no line reached _parse_line and none was malformed, or
    None; its names are ``canonical``'s objects for them where it has them (equal strings).
    Every line must hold one sample, and its text after its last blank must be the token the
    fast path read: the text before ends with '"}' (the '"} ' the fast path cut at: a token
    without a blank holds no other) or is a bare name. Then a line with the same text up to that
    blank and a plain token takes the same path to the same name and labels (the run checks read
    only the text before the token, and the token checks are _Shape's)."""
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
        names.append((canonical.get(name, name), placements))
    return _Shape(prefixes, names)
