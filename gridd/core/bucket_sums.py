"""Cumulative histogram buckets summed across series (the latency window's TTFT sums).

Summing several series' cumulative counts bucket by bucket gives the cumulative histogram of
their union. ``summed_buckets`` is the reference: per bucket line, its ``le`` read as a number
(a bound that is no number is skipped, as is a NaN count), sums keyed by bound, in bound order.
``same_layout`` and ``layout_sum`` are its C-level form for the usual case, every series a
bucket run with the same ``le`` texts: the same counts added in the same order.
"""

from __future__ import annotations

import math
import operator

from gridd.core.exposition_result import BucketRun, Entry

__all__ = ["BucketLayout", "add_bucket", "layout_sum", "same_layout", "same_layout_sum", "summed_buckets"]


def summed_buckets(counted: list[Entry]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The sums of the entries counted (samples with an ``le`` label, or bucket runs), as
    (bounds, cumulative counts) in bound order; the latency window's _buckets."""
    if not counted:
        return (), ()
    summed = same_layout_sum(counted)
    if summed is not None:
        return summed
    per_le: dict[float, float] = {}
    for entry in counted:
        if isinstance(entry, BucketRun):
            for bound, value in zip(entry.les, entry.values, strict=True):
                if not math.isnan(value):
                    add_bucket(per_le, bound, value)
            continue
        labels, value = entry
        le_text = labels.get("le")
        if le_text is not None and not math.isnan(value):
            add_bucket(per_le, le_text, value)
    if not per_le:
        return (), ()
    bounds, counts = zip(*sorted(per_le.items()), strict=True)
    return bounds, counts


# A bucket layout that same_layout_sum sums: its bounds in order, and where each sits in the
# runs' order (None: they list them in order already).
BucketLayout = tuple[tuple[float, ...], list[int] | None]


def same_layout_sum(counted: list[Entry]) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """_buckets' sums in C-level steps when every series counted is a BucketRun with the same
    le texts, distinct numeric bounds and no NaN count (the usual histogram); else None.
    Each bound's sum adds the same counts in the same order as the per-bucket loop."""
    layout = same_layout(counted)
    if layout is None:
        return None
    # (same_layout found every series counted a BucketRun: the filter keeps them all.)
    runs: list[float | list[float]] = [run.values for run in counted if isinstance(run, BucketRun)]
    return layout_sum(runs, layout)


def same_layout(counted: list[Entry]) -> BucketLayout | None:
    """The layout every series counted shares, when each is a BucketRun with the same le texts
    and those are distinct numeric bounds; else None. Labels alone decide it."""
    first = counted[0]
    if not isinstance(first, BucketRun):
        return None
    texts = first.les
    try:
        bounds = list(map(float, texts))
    except ValueError:
        return None
    if any(map(math.isnan, bounds)) or len(set(bounds)) != len(bounds):
        return None
    if not all(isinstance(run, BucketRun) and run.les == texts for run in counted):
        return None
    # The bounds are distinct: sorting them alone orders (bound, sum) pairs as sorting the pairs.
    order = sorted(range(len(bounds)), key=bounds.__getitem__)
    return tuple(map(bounds.__getitem__, order)), None if order == list(range(len(bounds))) else order


def layout_sum(counted: list[float | list[float]], layout: BucketLayout
                ) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The runs' counts (Exposition.entry_values) summed bucket by bucket from 0.0, in run order,
    and put in bound order; None when one is a sample, not a run, or a count is NaN (the
    per-bucket loop leaves those out)."""
    bounds, order = layout
    sums = [0.0] * len(bounds)
    for run in counted:
        if not isinstance(run, list) or any(map(math.isnan, run)):
            return None
        sums = list(map(operator.add, sums, run))
    return bounds, tuple(sums) if order is None else tuple(map(sums.__getitem__, order))


def add_bucket(per_le: dict[float, float], le_text: str, value: float) -> None:
    """Add one bucket's count under its bound; a bound that is no number is skipped."""
    try:
        le = float(le_text)
    except ValueError:
        return
    per_le[le] = per_le.get(le, 0.0) + value
