"""Recent latency over a sliding window of scrapes (spec: Provider Latency; DESIGN 5, 5b).

LatencyWindow keeps cumulative counter snapshots of one provider, one per successful
scrape, and differences the newest against a baseline inside the window:

- window: the baseline is the *oldest held snapshot taken at or after now - window_s*,
  so the block never covers more than window_s. Snapshots taken before now - window_s are
  dropped on every observe, which bounds memory to one window of scrapes. Until a full
  window has been held (start-up, after a counter reset or a scrape gap) the baseline is
  the oldest snapshot there is and the block covers a shorter span; LatencyBlock.window_s
  is the span actually covered (newest minus baseline time).
- completed = successes + failures in the window; a block is built only when
  completed >= min_completed ("only when at least 20 requests completed in that window").
- counter reset: any cumulative value lower than in the previous snapshot (an EPP or vLLM
  restart) drops the history; "A restart resets its counters and the window starts over."

Sources (docs/signals.md, "Latency"):

- EPP rows count only for the provider's own model (and configured adapters): the
  ``model_name`` label must be one of ``models`` ("never borrowed"; docs/signals.md).
- EPP: successes = sum of llm_d_epp_request_duration_seconds_count (recorded only for
  successful requests; legacy inference_objective_request_duration_seconds_count when the
  canonical family is absent). failures = sum of llm_d_epp_request_error_total over
  error codes, except the rows with model_name="" (bodies the EPP could not parse: they
  name no model and never reach request_total). TTFT from
  llm_d_epp_request_ttft_seconds, streaming="true" rows only; TPOT = delta(sum) /
  delta(count) of llm_d_epp_request_streaming_tpot_seconds.
- vLLM: completed = sum of vllm:request_success_total over finished_reason; successes
  (engine answers) exclude finished_reason "abort" and "error"; vLLM has no failure
  count that tells a failed request from a client cancellation, so error_ratio is None.
  TTFT from vllm:time_to_first_token_seconds; TPOT from
  vllm:request_time_per_output_token_seconds (per-request mean, the EPP's definition),
  else vllm:inter_token_latency_seconds, else vllm:time_per_output_token_seconds.

Pure: ``now`` is a monotonic float of seconds passed in by the caller.

A window keeps, per Exposition.layout, what its snapshot reads by label (LatencyPlan: each
sum's family and own rows, the counted TTFT runs and their bucket layout; VllmLatencyPlan:
a vLLM source's TTFT bucket bounds), so a scrape of a repeated layout only adds values.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import NamedTuple

from gridd.core.bucket_sums import layout_sum, same_layout, summed_buckets
from gridd.core.exposition import BucketRun, Exposition
from gridd.core.exposition_result import Entry
from gridd.core.readings import LatencyBlock

__all__ = [
    "DEFAULT_ENGINE_ANSWER_WINDOW_S",
    "DEFAULT_LATENCY_WINDOW_S",
    "DEFAULT_MIN_COMPLETED",
    "LatencyWindow",
    "histogram_quantile",
]

DEFAULT_LATENCY_WINDOW_S = 30.0
DEFAULT_MIN_COMPLETED = 20
MAX_COMPLETED = 2**53
"""A counter jump past this is clamped (the wire carries 64-bit integers)."""
DEFAULT_ENGINE_ANSWER_WINDOW_S = 30.0

_EPP_SUCCESS = ("llm_d_epp_request_duration_seconds_count",
                "inference_objective_request_duration_seconds_count")
_EPP_ERRORS = ("llm_d_epp_request_error_total", "inference_objective_request_error_total")
_EPP_TTFT_BUCKET = "llm_d_epp_request_ttft_seconds_bucket"
_EPP_TPOT = ("llm_d_epp_request_streaming_tpot_seconds",)

_VLLM_SUCCESS = "vllm:request_success_total"
_VLLM_NOT_ANSWERED = frozenset({"abort", "error"})
_VLLM_TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
_VLLM_TPOT = ("vllm:request_time_per_output_token_seconds",
              "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds")

Buckets = tuple[tuple[float, float], ...]


class _Snapshot(NamedTuple):
    """Cumulative counters of one scrape (immutable; a NamedTuple is built at a third of a
    frozen dataclass' cost, once per scrape)."""

    at: float
    source: str  # "epp" or "vllm"
    successes: float
    completed: float
    failures: float | None  # None: the source has no failure count
    # The TTFT histogram: upper bounds, sorted, +Inf last, and their cumulative counts.
    ttft_bounds: tuple[float, ...]
    ttft_counts: tuple[float, ...]
    tpot_sum: float
    tpot_count: float

    def scalars(self) -> tuple[float, float, float, float, float]:
        """The cumulative counters but the TTFT buckets."""
        failures = 0.0 if self.failures is None else self.failures
        return (self.successes, self.completed, failures, self.tpot_sum, self.tpot_count)


Models = frozenset[str] | None
"""The ``model_name`` values whose EPP rows are this provider's; None takes every row."""


def _is_ours(labels: dict[str, str], models: Models) -> bool:
    """Spec: latency is "never borrowed". One EPP can serve several models (a pool with
    LoRA adapters, several pools), and labels its request families by the client-sent
    ``model_name``; only the provider's own model (and its configured adapters) count. A
    row without the label at all (a build that does not set it) cannot be told apart and
    counts; ``model_name=""`` (a body the EPP could not parse) and the cap's ``other``
    never match a configured name."""
    if models is None:
        return True
    name = labels.get("model_name")
    return name is None or name in models


def _total(expo: Exposition, families: tuple[str, ...], models: Models, *,
           skip_empty_model: bool = False) -> float:
    """Sum of the first family present (canonical before legacy; never both: an EPP from
    v0.9 on emits both under dual emission, and adding them would count twice)."""
    for family in families:
        rows = expo.series(family)
        if rows:
            return sum(v for labels, v in rows if math.isfinite(v) and _is_ours(labels, models)
                       and not (skip_empty_model and labels.get("model_name") == ""))
    return 0.0


def _buckets(expo: Exposition, family: str, models: Models, *,
             streaming_only: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Cumulative bucket counts summed across label sets per ``le``: (bounds, counts), sorted
    by bound.

    Summing cumulative counts of several series bucket by bucket yields the cumulative
    histogram of their union (all EPP flows share one bucket layout).
    """
    entries = expo.entries(family)
    return summed_buckets([entries[i] for i in _counted_buckets(entries, models, streaming_only)])


def _counted_buckets(entries: list[Entry], models: Models, streaming_only: bool) -> list[int]:
    """Which of a bucket family's entries _buckets counts (by their labels alone)."""
    counted: list[int] = []
    for index, entry in enumerate(entries):
        labels = entry.labels if isinstance(entry, BucketRun) else entry[0]
        if streaming_only and labels.get("streaming") != "true":
            continue
        if models is not None:  # _is_ours, inline: a histogram has a line per bucket
            model = labels.get("model_name")
            if model is not None and model not in models:
                continue
        counted.append(index)
    return counted


def _sum_count(expo: Exposition, histograms: tuple[str, ...], models: Models = None) -> tuple[float, float]:
    for name in histograms:
        count_rows = expo.series(f"{name}_count")
        if count_rows:
            total = sum(v for labels, v in expo.series(f"{name}_sum")
                        if math.isfinite(v) and _is_ours(labels, models))
            return total, sum(v for labels, v in count_rows if math.isfinite(v) and _is_ours(labels, models))
    return 0.0, 0.0


def _snapshot(now: float, expo: Exposition, *, kind: str = "auto", models: Models = None) -> _Snapshot:
    """kind: "epp" or "vllm" reads that source's families; "auto" takes vLLM's when the
    body has any vllm:* series. models: applies to the EPP's rows only (an engine serves
    one model, labelled with its first --served-model-name, which need not be the
    provider's name)."""
    if _is_vllm_source(expo, kind):
        return _vllm_snapshot(now, expo, _buckets(expo, _VLLM_TTFT_BUCKET, None, streaming_only=False))
    successes = _total(expo, _EPP_SUCCESS, models)
    failures = _total(expo, _EPP_ERRORS, models, skip_empty_model=True)
    tpot_sum, tpot_count = _sum_count(expo, _EPP_TPOT, models)
    bounds, counts = _buckets(expo, _EPP_TTFT_BUCKET, models, streaming_only=True)
    return _Snapshot(at=now, source="epp", successes=successes, completed=successes + failures,
                     failures=failures, ttft_bounds=bounds, ttft_counts=counts,
                     tpot_sum=tpot_sum, tpot_count=tpot_count)


# Which rows of a family a sum reads: (family, their indices in expo.series(family)), or None
# when no family of the list has rows (the sum is 0.0).
_Rows = tuple[str, list[int]] | None


def _ours(expo: Exposition, families: tuple[str, ...], models: Models, *,
          skip_empty_model: bool = False) -> _Rows:
    """The rows _total sums, by their labels: the first family with rows, its rows of ours."""
    for family in families:
        rows = expo.series(family)
        if rows:
            return family, [index for index, (labels, _) in enumerate(rows) if _is_ours(labels, models)
                            and not (skip_empty_model and labels.get("model_name") == "")]
    return None


def _finite_sum(expo: Exposition, rows: _Rows) -> float:
    """_total's sum over the rows _ours picked: their finite values, in row order. A finite
    sum of them all had no NaN or infinity to leave out, so it is that sum (the same values
    added in the same order)."""
    if rows is None:
        return 0.0
    series = expo.values(rows[0])
    values = [series[index] for index in rows[1]]
    total = sum(values)
    return total if math.isfinite(total) else sum(v for v in values if math.isfinite(v))


class LatencyPlan:
    """What _snapshot reads from an EPP exposition's names and labels alone: which family each
    sum reads and which of its rows are the provider's (_is_ours), and which TTFT bucket
    entries count. Built by latency_plan from one exposition, ``snapshot`` gives _snapshot's
    result for any exposition with the same names and labels in the same order (the same
    Exposition.layout): the same values, picked by position instead of by label, summed in
    the same order."""

    __slots__ = ("models", "successes", "failures", "tpot_sum", "tpot_count", "ttft_entries", "ttft",
                 "ttft_layout")

    def __init__(self, expo: Exposition, models: Models) -> None:
        self.models = models
        self.successes = _ours(expo, _EPP_SUCCESS, models)
        self.failures = _ours(expo, _EPP_ERRORS, models, skip_empty_model=True)
        # _sum_count: the first histogram with count rows gives both sums.
        self.tpot_sum: _Rows = None
        self.tpot_count: _Rows = None
        for name in _EPP_TPOT:
            if expo.series(f"{name}_count"):
                self.tpot_sum = _ours(expo, (f"{name}_sum",), models) or (f"{name}_sum", [])
                self.tpot_count = _ours(expo, (f"{name}_count",), models)
                break
        entries = expo.entries(_EPP_TTFT_BUCKET)
        # Positions among the entries as the parse left them (runs, not yet written out as
        # samples by a series() call: the count tells).
        self.ttft_entries = len(entries)
        self.ttft = _counted_buckets(entries, models, True)
        # The bucket layout the counted runs share (their le texts: labels), if they do.
        self.ttft_layout = same_layout([entries[index] for index in self.ttft]) if self.ttft else None

    def snapshot(self, now: float, expo: Exposition) -> _Snapshot:
        successes = _finite_sum(expo, self.successes)
        failures = _finite_sum(expo, self.failures)
        if self.tpot_count is None:
            tpot_sum, tpot_count = 0.0, 0.0
        else:
            tpot_sum, tpot_count = _finite_sum(expo, self.tpot_sum), _finite_sum(expo, self.tpot_count)
        runs = expo.entry_values(_EPP_TTFT_BUCKET)
        if len(runs) != self.ttft_entries:
            bounds, counts = _buckets(expo, _EPP_TTFT_BUCKET, self.models, streaming_only=True)
        elif not self.ttft:
            bounds, counts = (), ()  # none counted: summed_buckets of nothing
        else:
            summed = (None if self.ttft_layout is None
                      else layout_sum([runs[index] for index in self.ttft], self.ttft_layout))
            if summed is None:
                entries = expo.entries(_EPP_TTFT_BUCKET)
                summed = summed_buckets([entries[index] for index in self.ttft])
            bounds, counts = summed
        return _Snapshot(at=now, source="epp", successes=successes, completed=successes + failures,
                         failures=failures, ttft_bounds=bounds, ttft_counts=counts,
                         tpot_sum=tpot_sum, tpot_count=tpot_count)


def _is_vllm_source(expo: Exposition, kind: str) -> bool:
    return kind == "vllm" or (kind == "auto" and any(name.startswith("vllm:") for name in expo.names()))


def latency_plan(expo: Exposition, *, kind: str, models: Models) -> LatencyPlan | VllmLatencyPlan:
    """The plan _snapshot(expo, kind=kind, models=models) reads through: a VllmLatencyPlan for a
    vLLM source (models apply to the EPP's rows only), else a LatencyPlan."""
    return VllmLatencyPlan(expo) if _is_vllm_source(expo, kind) else LatencyPlan(expo, models)


def _vllm_snapshot(now: float, expo: Exposition, ttft: tuple[tuple[float, ...], tuple[float, ...]]
                   ) -> _Snapshot:
    """_snapshot of a vLLM source, its TTFT buckets summed (_buckets) already."""
    successes = completed = 0.0
    for labels, value in expo.series(_VLLM_SUCCESS):
        if not math.isfinite(value):
            continue
        completed += value
        if labels.get("finished_reason") not in _VLLM_NOT_ANSWERED:
            successes += value
    tpot_sum, tpot_count = _sum_count(expo, _VLLM_TPOT)
    return _Snapshot(at=now, source="vllm", successes=successes, completed=completed, failures=None,
                     ttft_bounds=ttft[0], ttft_counts=ttft[1], tpot_sum=tpot_sum, tpot_count=tpot_count)


class VllmLatencyPlan:
    """What _snapshot reads from a vLLM exposition's TTFT bucket labels alone. Runs (``le`` the
    last label, as prometheus_client writes it): the bucket layout they share, as LatencyPlan
    keeps it. Bucket lines (``le`` elsewhere; one or a few series, which _buckets sums per le
    the slow way, a float() and a dict update per line): each line's bound as a slot among
    the distinct bounds in order, -1 for a line add_bucket skips (no ``le``, or no number).
    ``snapshot`` gives _snapshot's result for an exposition of the same layout (the same
    lines with the same labels in the same order)."""

    __slots__ = ("ttft_layout", "slots", "bounds")

    def __init__(self, expo: Exposition) -> None:
        entries = expo.entries(_VLLM_TTFT_BUCKET)
        runs = any(isinstance(entry, BucketRun) for entry in entries)
        self.ttft_layout = same_layout(entries) if runs else None  # None unless all share one
        line_bounds: list[float | None] = []
        for entry in entries:
            le_text = None if isinstance(entry, BucketRun) else entry[0].get("le")
            try:
                line_bounds.append(None if le_text is None else float(le_text))
            except ValueError:
                line_bounds.append(None)
        # A bound's first spelling is its key (as in per_le: -0 and 0 are one bound; each NaN
        # parsed is a key of its own there too, and sorts as there: bounds alone are compared).
        self.bounds = tuple(sorted(dict.fromkeys(b for b in line_bounds if b is not None)))
        slot_of = {bound: slot for slot, bound in enumerate(self.bounds)}
        self.slots: list[int] | None = [-1 if b is None else slot_of[b] for b in line_bounds]
        if runs or any(map(math.isnan, self.bounds)):
            # Runs: summed_buckets sums them. A NaN bound: every scrape's per_le holds a new
            # NaN, equal to none before it, so the plain path sees a bucket layout change (a
            # reset) each time, where kept bounds would compare equal: the plain path reads it.
            self.slots = None

    def snapshot(self, now: float, expo: Exposition) -> _Snapshot:
        # The layout's lines: the same entries (a series() call would only write runs out as
        # lines, which layout_sum refuses).
        if self.ttft_layout is not None:
            summed = layout_sum(expo.entry_values(_VLLM_TTFT_BUCKET), self.ttft_layout)
            if summed is not None:  # None for a NaN count: the plain path
                return _vllm_snapshot(now, expo, summed)
        elif self.slots is not None:
            entries = expo.entries(_VLLM_TTFT_BUCKET)
            # per_le[le] = per_le.get(le, 0.0) + value, line by line: each slot adds the same
            # values from 0.0 in the same order. With no NaN count every bound is in per_le
            # (its first spelling the key); a NaN count (skipped there) takes the plain path.
            sums = [0.0] * len(self.bounds)
            for entry, slot in zip(entries, self.slots, strict=True):
                if isinstance(entry, BucketRun) or (slot >= 0 and math.isnan(entry[1])):
                    break  # (no run among the layout's lines: the check narrows the type)
                if slot >= 0:
                    sums[slot] += entry[1]
            else:
                return _vllm_snapshot(now, expo, (self.bounds, tuple(sums)))
        return _vllm_snapshot(now, expo, _buckets(expo, _VLLM_TTFT_BUCKET, None, streaming_only=False))


def _is_reset(prev: _Snapshot, cur: _Snapshot) -> bool:
    """A restart: the source changed, a bucket layout changed, or a counter went down.

    A histogram first appearing (no streaming request before) is not a layout change: its
    buckets were all zero.
    """
    if prev.source != cur.source or cur.at < prev.at:
        return True
    if prev.ttft_bounds and cur.ttft_bounds != prev.ttft_bounds:
        return True
    # prev may lack the TTFT buckets (no streaming request yet): compare what both have.
    return (any(map(operator.lt, cur.scalars(), prev.scalars()))  # both five values
            or any(map(operator.lt, cur.ttft_counts, prev.ttft_counts)))


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a cumulative histogram, as Prometheus' histogram_quantile does.

    buckets: (upper bound, cumulative count) sorted by bound, ending with +Inf. The rank
    q * total falls in the first bucket whose cumulative count reaches it; the value is
    interpolated linearly between that bucket's lower and upper bounds (the lowest
    bucket's lower bound is 0). A rank in the +Inf bucket returns the last finite upper
    bound. None when there are no observations or no +Inf bucket.
    """
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        return None
    bounds, counts = zip(*buckets, strict=True)
    return _quantile(q, bounds, _monotonic(counts))


def _monotonic(counts: Iterable[float]) -> list[float]:
    """Prometheus' ensureMonotonic: deltas of cumulative counts taken at slightly different
    instants can dip; a bucket never holds fewer than the one below it (a running max from
    0, NaN counts left out by max)."""
    return list(accumulate(counts, max, initial=0.0))[1:]


def _quantile(q: float, bounds: Sequence[float], counts: list[float]) -> float | None:
    """histogram_quantile on bounds ending with +Inf and their _monotonic counts."""
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    # The first bucket whose count reaches the rank: counts never decrease.
    b = bisect_left(counts, rank)
    if b == len(counts) or not counts[b] >= rank:
        # q above 1 or NaN: no bucket reaches the rank (StopIteration, as always).
        b = next(i for i, count in enumerate(counts) if count >= rank)
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else counts[b - 1]
    return start + (bounds[b] - start) * (rank - below) / (counts[b] - below)


class LatencyWindow:
    """One provider's latency window and engine-answer record. Feed every successful scrape.

    observe(now, expo) returns the LatencyBlock over the window ending at ``now``, or None
    (fewer than min_completed completions in it, or no baseline yet).
    """

    __slots__ = ("window_s", "min_completed", "kind", "models", "_snapshots", "_last_answer_at",
                 "_answered_on_last_observe", "resets", "_plan_layout", "_plan")

    def __init__(self, window_s: float = DEFAULT_LATENCY_WINDOW_S,
                 min_completed: int = DEFAULT_MIN_COMPLETED, *, kind: str = "auto",
                 models: Models = None) -> None:
        """kind: the provider's metrics.kind ("auto", "epp" or "vllm"). models: the
        model_name values whose EPP rows are the provider's (its model and adapters);
        None takes every row."""
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        if min_completed < 1:
            raise ValueError("min_completed must be at least 1")
        self.window_s = window_s
        self.min_completed = min_completed
        self.kind = kind
        self.models = models
        self._snapshots: deque[_Snapshot] = deque()
        self._last_answer_at: float | None = None
        self._answered_on_last_observe = False
        # Counter resets seen (EPP or vLLM restarts), for a metric.
        self.resets = 0
        # The layout of the latest exposition read (Exposition.layout) and what _snapshot
        # reads of it by label.
        self._plan_layout: object | None = None
        self._plan: LatencyPlan | VllmLatencyPlan | None = None

    @property
    def last_answer_at(self) -> float | None:
        """When the latest engine answer was observed: the time of the later of the two
        scrapes between which the success counter rose. None before any."""
        return self._last_answer_at

    @property
    def answered_on_last_observe(self) -> bool:
        """Whether the latest observe saw the success counter rise since the scrape before
        (what ReadinessTracker.on_scrape takes as ``engine_answered``)."""
        return self._answered_on_last_observe

    @property
    def snapshots_held(self) -> int:
        """Snapshots held: the baseline and every newer one (at most one window's worth)."""
        return len(self._snapshots)

    def engine_answered_within(self, now: float, within_s: float = DEFAULT_ENGINE_ANSWER_WINDOW_S) -> bool:
        """DESIGN 5: an engine answer is the provider's request counters showing a completed
        successful request. True when a success-counter increase was observed between two
        scrapes, the later of them at most within_s before now (inclusive)."""
        return self._last_answer_at is not None and now - self._last_answer_at <= within_s

    def observe(self, now: float, expo: Exposition) -> LatencyBlock | None:
        layout = expo.layout
        if layout is None:
            self._plan_layout = self._plan = None  # nor keep an old layout alive
            snap = _snapshot(now, expo, kind=self.kind, models=self.models)
        else:
            # What _snapshot reads by label is kept while the exposition's layout comes back
            # (same names and labels in the same order: LatencyPlan reads the same rows).
            if layout is not self._plan_layout:
                self._plan = latency_plan(expo, kind=self.kind, models=self.models)
                self._plan_layout = layout
            plan = self._plan
            snap = (_snapshot(now, expo, kind=self.kind, models=self.models) if plan is None
                    else plan.snapshot(now, expo))
        self._answered_on_last_observe = False
        if self._snapshots:
            prev = self._snapshots[-1]
            if _is_reset(prev, snap):
                # "A restart resets its counters and the window starts over." Completions
                # since the restart cannot be dated, so they are not an engine answer.
                self._snapshots.clear()
                self.resets += 1
            elif snap.successes > prev.successes:
                self._last_answer_at = now
                self._answered_on_last_observe = True
        self._snapshots.append(snap)
        start = now - self.window_s
        while self._snapshots[0].at < start:
            self._snapshots.popleft()
        base = self._snapshots[0]
        if base is snap:
            return None
        return self._block(base, snap)

    def _block(self, base: _Snapshot, cur: _Snapshot) -> LatencyBlock | None:
        completed = cur.completed - base.completed
        if not self.min_completed <= completed < math.inf:  # too few; or counters summing past
            return None  # floats (inf, or inf - inf = NaN): no count to publish, nor a crash
        bounds, counts = cur.ttft_bounds, cur.ttft_counts
        if base.ttft_counts:
            if len(base.ttft_counts) != len(counts):
                raise ValueError("bucket layouts differ inside one window")  # _is_reset prevents it
            counts = tuple(map(operator.sub, counts, base.ttft_counts))
        ttft_p50 = ttft_p90 = None
        if len(bounds) >= 2 and bounds[-1] == math.inf:  # histogram_quantile, both at once
            monotonic = _monotonic(counts)
            ttft_p50, ttft_p90 = _quantile(0.5, bounds, monotonic), _quantile(0.9, bounds, monotonic)
        tpot_count = cur.tpot_count - base.tpot_count
        tpot = (cur.tpot_sum - base.tpot_sum) / tpot_count if tpot_count > 0 else None
        error_ratio = None
        if cur.failures is not None and base.failures is not None:
            error_ratio = (cur.failures - base.failures) / completed
        return LatencyBlock(
            window_s=cur.at - base.at,
            completed=min(MAX_COMPLETED, int(round(completed))),
            ttft_p50_s=ttft_p50,
            ttft_p90_s=ttft_p90,
            tpot_s=tpot,
            error_ratio=error_ratio,
        )
