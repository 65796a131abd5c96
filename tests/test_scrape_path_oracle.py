"""The per-body scrape path (parse -> kind check -> derive -> latency window) against a
straightforward reference, on the reference samples and on generated EPP and vLLM bodies.

The parse keeps a histogram series' bucket lines as one run (gridd.core.exposition.BucketRun)
and the latency window reads them as runs. The reference parses line by line with the full
grammar (_parse_line) and the documented malformed-count rule, hands derive plain (labels
dict, value) samples, and its latency window (below) differences (bound, count) pairs as
gridd's window did before. Samples (as `samples` and as `series`), malformed counts, kind
mismatches, derivations, latency blocks, engine answers and resets must all be equal.
"""

from __future__ import annotations

import math
import pathlib
import random
from collections.abc import Callable, Container

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gridd.core.exposition as exposition_module
from gridd.core.derivation import WANTED_SAMPLES, derive, kind_mismatch, pool_names
from gridd.core.exposition import (
    BucketRun,
    Exposition,
    SeriesCache,
    TooManyLines,
    _parse_line,
    _refuse_over,
    parse_exposition,
)
from gridd.core.exposition_scan import _scan
from gridd.core.latency import (
    _EPP_ERRORS,
    _EPP_SUCCESS,
    _EPP_TPOT,
    _EPP_TTFT_BUCKET,
    _VLLM_SUCCESS,
    _VLLM_TPOT,
    _VLLM_TTFT_BUCKET,
    LatencyWindow,
    _buckets,
    histogram_quantile,
)
from gridd.core.publication import MAX_EXPOSITION_LINES, ProviderPublisher
from gridd.core.readings import LatencyBlock

Samples = dict[str, list[tuple[dict[str, str], float]]]
MODEL = "m"
LEADING_NAME = "[a-zA-Z_:][a-zA-Z0-9_:]*"


def reference_parse(text: str, wanted: Container[str] | None) -> tuple[Samples, int]:
    """Every line by the full grammar; a malformed line counts unless its leading name is a
    valid name that is not wanted (docs/metrics.md: grid_provider_parse_dropped_lines_total)."""
    import re

    samples: Samples = {}
    malformed = 0
    for line in text.split("\n"):
        parsed = _parse_line(line)
        if parsed is None:
            head = re.match(rf"[ \t]*({LEADING_NAME})", line)
            malformed += wanted is None or head is None or head.group(1) in wanted
        elif parsed:
            name, labels, value = parsed
            if wanted is None or name in wanted:
                samples.setdefault(name, []).append((labels, value))
    return samples, malformed


def plain_exposition(samples: Samples, malformed: int) -> Exposition:
    """An Exposition holding the reference's samples."""
    expo = Exposition()
    expo.samples.update({name: list(series) for name, series in samples.items()})
    expo.malformed_lines = malformed
    return expo


def comparable(samples: Samples) -> dict[str, list[tuple[dict[str, str], object]]]:
    return {name: [(labels, "NaN" if math.isnan(v) else v) for labels, v in series]
            for name, series in samples.items()}


# --- the reference latency window: (bound, count) pairs, as the window kept them before ---

def _ours(labels: dict[str, str], models: frozenset[str] | None) -> bool:
    return models is None or labels.get("model_name") is None or labels["model_name"] in models


def _ref_snapshot(now: float, samples: Samples, kind: str, models: frozenset[str] | None) -> dict:
    def rows(name: str) -> list[tuple[dict[str, str], float]]:
        return samples.get(name, [])

    def total(families: tuple[str, ...], skip_empty: bool = False) -> float:
        for family in families:
            if rows(family):
                return sum(v for labels, v in rows(family) if math.isfinite(v) and _ours(labels, models)
                           and not (skip_empty and labels.get("model_name") == ""))
        return 0.0

    def sum_count(histograms: tuple[str, ...], models_: frozenset[str] | None) -> tuple[float, float]:
        for name in histograms:
            if rows(f"{name}_count"):
                picked = [[v for labels, v in rows(name + part)
                           if math.isfinite(v) and _ours(labels, models_)] for part in ("_sum", "_count")]
                return sum(picked[0]), sum(picked[1])
        return 0.0, 0.0

    def buckets(family: str, models_: frozenset[str] | None, streaming_only: bool) -> tuple:
        return _ref_buckets(samples, family, models_, streaming_only)

    if kind == "vllm" or (kind == "auto" and any(name.startswith("vllm:") for name in samples)):
        completed = sum(v for _, v in rows(_VLLM_SUCCESS) if math.isfinite(v))
        successes = sum(v for labels, v in rows(_VLLM_SUCCESS)
                        if math.isfinite(v) and labels.get("finished_reason") not in ("abort", "error"))
        tpot = sum_count(_VLLM_TPOT, None)
        return dict(at=now, source="vllm", successes=successes, completed=completed, failures=None,
                    ttft=buckets(_VLLM_TTFT_BUCKET, None, False), tpot=tpot)
    successes, failures = total(_EPP_SUCCESS), total(_EPP_ERRORS, skip_empty=True)
    return dict(at=now, source="epp", successes=successes, completed=successes + failures, failures=failures,
                ttft=buckets(_EPP_TTFT_BUCKET, models, True), tpot=sum_count(_EPP_TPOT, models))


def _ref_buckets(samples: Samples, family: str, models: frozenset[str] | None, streaming_only: bool) -> tuple:
    """Cumulative counts summed per bound, bucket line by bucket line."""
    per_le: dict[float, float] = {}
    for labels, value in samples.get(family, []):
        if streaming_only and labels.get("streaming") != "true" or not _ours(labels, models):
            continue
        if labels.get("le") is None or math.isnan(value):
            continue
        try:
            le = float(labels["le"])
        except ValueError:
            continue
        per_le[le] = per_le.get(le, 0.0) + value
    return tuple(sorted(per_le.items()))


def _quantile(q: float, buckets: tuple) -> float | None:
    """histogram_quantile, bucket by bucket as it was written first."""
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        return None
    bounds: list[float] = []
    counts: list[float] = []
    running_max = 0.0
    for bound, count in buckets:
        running_max = max(running_max, count)
        bounds.append(bound)
        counts.append(running_max)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, count in enumerate(counts) if count >= rank)
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else counts[b - 1]
    return start + (bounds[b] - start) * (rank - below) / (counts[b] - below)


def _counters(snap: dict) -> list[float]:
    return [snap["successes"], snap["completed"], snap["failures"] or 0.0, *snap["tpot"],
            *(count for _, count in snap["ttft"])]


class ReferenceWindow:
    def __init__(self, kind: str, models: frozenset[str] | None, window_s: float = 5.0) -> None:
        self.kind, self.models, self.window_s = kind, models, window_s
        self.snapshots: list[dict] = []
        self.answered = False
        self.resets = 0

    def observe(self, now: float, samples: Samples) -> LatencyBlock | None:
        snap = _ref_snapshot(now, samples, self.kind, self.models)
        self.answered = False
        if self.snapshots:
            prev = self.snapshots[-1]
            layouts = [le for le, _ in prev["ttft"]], [le for le, _ in snap["ttft"]]
            if (prev["source"] != snap["source"] or snap["at"] < prev["at"]
                    or (prev["ttft"] and snap["ttft"] and layouts[0] != layouts[1])
                    or (prev["ttft"] and not snap["ttft"])
                    or any(c < p for p, c in zip(_counters(prev), _counters(snap), strict=False))):
                self.snapshots.clear()
                self.resets += 1
            elif snap["successes"] > prev["successes"]:
                self.answered = True
        self.snapshots.append(snap)
        self.snapshots = [s for s in self.snapshots if s["at"] >= now - self.window_s]
        base = self.snapshots[0]
        if base is snap or snap["completed"] - base["completed"] < 1:
            return None
        completed = snap["completed"] - base["completed"]
        ttft = tuple((le, c - b) for (le, c), (_, b) in zip(snap["ttft"], base["ttft"], strict=True)) \
            if base["ttft"] else snap["ttft"]
        tpot_count = snap["tpot"][1] - base["tpot"][1]
        return LatencyBlock(
            window_s=snap["at"] - base["at"],
            completed=min(2**53, int(round(completed))),
            ttft_p50_s=_quantile(0.5, ttft),
            ttft_p90_s=_quantile(0.9, ttft),
            tpot_s=(snap["tpot"][0] - base["tpot"][0]) / tpot_count if tpot_count > 0 else None,
            error_ratio=None if snap["failures"] is None or base["failures"] is None
            else (snap["failures"] - base["failures"]) / completed,
        )


def same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN (repr of msgspec structs and floats shows it)."""
    return a == b or repr(a) == repr(b)


def check_path(bodies: list[str], kind: str, pool: str | None = None) -> None:
    """Parse, derive and observe each body through gridd and through the reference.

    The consumers read the parse the operator makes: with the provider's SeriesCache, kept
    from body to body (its series shared between the parses), after a parse without it."""
    window = LatencyWindow(window_s=5.0, min_completed=1, kind=kind, models=frozenset({MODEL}))
    reference = ReferenceWindow(kind, frozenset({MODEL}))
    cache = SeriesCache()
    for now, body in enumerate(bodies):
        expected, malformed = reference_parse(body, WANTED_SAMPLES)
        # Reading `samples` writes the bucket runs out as samples; the consumers read a parse
        # whose runs are still runs, as on the operator's path.
        written = parse_exposition(body.encode(), WANTED_SAMPLES)
        assert (comparable(written.samples), written.malformed_lines) == (comparable(expected), malformed)
        by_name = parse_exposition(body.encode(), WANTED_SAMPLES, cache)
        assert comparable({name: by_name.series(name) for name in expected}) == comparable(expected)
        assert list(by_name.names()) == list(written.names())
        assert len(cache.series) <= cache.limit
        expo = parse_exposition(body.encode(), WANTED_SAMPLES, cache)
        assert expo.malformed_lines == malformed
        plain = plain_exposition(expected, malformed)
        assert kind_mismatch(expo, kind) == kind_mismatch(plain, kind)
        assert same(derive(expo, pool=pool, queue_full_at=2, kind=kind),
                    derive(plain, pool=pool, queue_full_at=2, kind=kind))
        # As on_scrape calls them: the pools read once, for both.
        pools = pool_names(expo)
        assert kind_mismatch(expo, kind, pools=pools) == kind_mismatch(plain, kind)
        assert same(derive(expo, pool=pool, queue_full_at=2, kind=kind, pools=pools),
                    derive(plain, pool=pool, queue_full_at=2, kind=kind))
        for family, streaming_only, models in ((_EPP_TTFT_BUCKET, True, frozenset({MODEL})),
                                               (_VLLM_TTFT_BUCKET, False, None)):
            # The summed histogram itself, not only the quantiles read from it.
            bounds, counts = _buckets(expo, family, models, streaming_only=streaming_only)
            assert same(tuple(zip(bounds, counts, strict=True)),
                        _ref_buckets(expected, family, models, streaming_only))
        block = window.observe(float(now), expo)
        assert same(block, reference.observe(float(now), expected)), now
        assert window.answered_on_last_observe == reference.answered
        assert window.resets == reference.resets


# --- generated bodies -----------------------------------------------------------------

def render(name: str, labels: list[tuple[str, str]], value: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return f"{name}{{{inner}}} {value}" if labels else f"{name} {value}"


LABEL_VALUES = ["p", "q", MODEL, "x", "", "true", "false", 'a\\"b', "c\\\\d", "e\\nf", "0"]
GAUGES = ["llm_d_epp_ready_endpoints", "inference_pool_ready_pods", "llm_d_epp_average_running_requests",
          "llm_d_epp_average_queue_size", "llm_d_epp_average_kv_cache_utilization",
          "llm_d_epp_std_dev_kv_cache_utilization", "llm_d_epp_per_endpoint_queue_size",
          "inference_pool_per_pod_queue_size", "llm_d_epp_inflight_requests",
          "llm_d_epp_flow_control_queue_size", "vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:kv_cache_usage_perc", "llm_d_epp_request_duration_seconds_count",
          "llm_d_epp_request_error_total", "llm_d_epp_request_streaming_tpot_seconds_sum",
          "llm_d_epp_request_streaming_tpot_seconds_count", "vllm:request_success_total",
          "vllm:request_time_per_output_token_seconds_sum",
          "vllm:request_time_per_output_token_seconds_count", "go_goroutines"]
GAUGE_LABELS = ["name", "model_server_endpoint", "model_server_pod", "endpoint_name", "namespace",
                "producer_name", "inference_pool", "engine", "model_name", "finished_reason", "error_code"]
BUCKETS = [_EPP_TTFT_BUCKET, _VLLM_TTFT_BUCKET, "llm_d_epp_request_duration_seconds_bucket"]
LES = ["0.1", "0.5", "1", "2.5", "+Inf", "1.0", "NaN", "x"]
COMMON_LES = ["0.1", "0.5", "1", "2.5", "+Inf"]
# Mostly the series the latency window counts: streaming, the provider's model.
BUCKET_LABEL_VALUES = {"streaming": ["true", "true", "false", 'a\\"b'], "model_name": [MODEL, MODEL, "x", ""]}
VALUES = ["0", "1", "3", "7", "12.5", "-1", "NaN", "+Inf", "-Inf", "1e3", "1_0", "x"]


@st.composite
def histogram_lines(draw) -> list[str]:
    """One series' bucket lines: random label order, le last (mostly) or not, cumulative
    counts (mostly), some lines edited, duplicated, or given a timestamp."""
    name = draw(st.sampled_from(BUCKETS))
    keys = draw(st.lists(st.sampled_from(["model_name", "streaming", "fairness_id", "engine"]),
                         unique=True, max_size=4))
    labels = [(k, draw(st.sampled_from(BUCKET_LABEL_VALUES.get(k, LABEL_VALUES)))) for k in keys]
    # Mostly one bucket layout for every series, as a client library writes a histogram.
    les = COMMON_LES if draw(st.integers(0, 2)) else sorted(
        draw(st.lists(st.sampled_from(LES), unique=True, min_size=1, max_size=5)), key=LES.index)
    at = len(labels) if draw(st.integers(0, 4)) else draw(st.integers(0, len(labels)))
    total = 0
    lines = []
    for le in les:
        total += draw(st.integers(0, 5))
        value = str(total) if draw(st.integers(0, 6)) else draw(st.sampled_from(VALUES))
        line = render(name, [*labels[:at], ("le", le), *labels[at:]], value)
        edit = draw(st.sampled_from(["", "", "", "", "", "timestamp", "dup", "cut", "space", "brace"]))
        if edit == "timestamp":
            line += " 1700000000000"
        elif edit == "dup":
            lines.append(line)
        elif edit == "cut":
            line = line[: draw(st.integers(0, len(line)))]
        elif edit == "space":
            line = line.replace("{", " {", 1)
        elif edit == "brace":
            line = line.replace('"} ', '"}', 1)
        lines.append(line)
    return lines


@st.composite
def gauge_lines(draw) -> list[str]:
    name = draw(st.sampled_from(GAUGES))
    keys = draw(st.lists(st.sampled_from(GAUGE_LABELS), unique=True, max_size=4))
    lines = []
    for _ in range(draw(st.integers(1, 3))):
        labels = [(k, draw(st.sampled_from(LABEL_VALUES))) for k in keys]
        lines.append(render(name, labels, draw(st.sampled_from(VALUES))))
    return lines


@st.composite
def bodies(draw) -> str:
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 8))):
        part = draw(st.sampled_from(["histogram", "histogram", "gauge", "gauge", "comment", "junk"]))
        if part == "histogram":
            lines += draw(histogram_lines())
        elif part == "gauge":
            lines += draw(gauge_lines())
        elif part == "comment":
            name = draw(st.sampled_from(GAUGES + BUCKETS))
            lines += [f"# HELP {name} Some help.", f"# TYPE {name} gauge", ""]
        else:
            lines.append(draw(st.sampled_from(["<html>", "  llm_d_epp_ready_endpoints 3", "7 7", "{}",
                                               '\tllm_d_epp_ready_endpoints{name="p"} 2'])))
    return draw(st.sampled_from(["\n", "\r\n"])).join(lines)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(bodies(), min_size=1, max_size=4), st.sampled_from(["auto", "epp", "vllm"]),
       st.sampled_from([None, "p"]))
def test_generated_bodies_take_the_reference_path(bodies: list[str], kind: str, pool: str | None) -> None:
    check_path(bodies, kind, pool)


def revalued(body: str, rng: random.Random) -> str:
    """The body scraped again: its lines' values replaced (by good and bad tokens), some
    given a timestamp, a blank or a cut, so a cached series meets every kind of token."""
    lines = []
    for line in body.split("\n"):
        head, blank, _ = line.rpartition(" ")
        edit = rng.randrange(8)
        if blank and edit < 5:
            line = f"{head} {rng.choice(VALUES)}"
        elif edit == 5:
            line += rng.choice([" 1700000000000", " ", "\t", "_", " 1 2"])
        elif edit == 6:
            line = line[: rng.randrange(len(line) + 1)]
        lines.append(line)
    return "\n".join(lines)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), st.randoms(use_true_random=False), st.sampled_from(["auto", "epp", "vllm"]))
def test_repeated_series_with_new_values_take_the_reference_path(body: str, rng: random.Random,
                                                                 kind: str) -> None:
    """One body scraped again and again with its values changed: the provider's SeriesCache
    serves the repeated series; every parse still equals the reference's."""
    check_path([body, revalued(body, rng), body, revalued(body, rng), revalued(body, rng)], kind)


def relabelled(body: str, rng: random.Random) -> str:
    """The body with a label value, a name or a line's start changed here and there: the
    same number of lines, not all of them the series of the scrape before."""
    lines = body.split("\n")
    for _ in range(rng.randrange(1, 3)):
        i = rng.randrange(len(lines))
        edit = rng.randrange(4)
        if edit == 0:
            lines[i] = lines[i].replace('="', '="z', 1)
        elif edit == 1:
            lines[i] = lines[i].replace("{", "_x{", 1)
        elif edit == 2:
            lines[i] = " " + lines[i]
        else:
            lines[i] = lines[i].replace('"} ', '",le="9"} ', 1)
    return "\n".join(lines)


@pytest.mark.parametrize("filename", ["epp-healthy.prom", "vllm-direct.prom"])
def test_a_repeated_body_shape_takes_the_reference_path(filename: str) -> None:
    """A real body scraped again with new values takes the repeated-shape path (its lines'
    prefixes unchanged: gridd.core.exposition_result._Shape); edited ones must leave it."""
    text = (SAMPLES_DIR / filename).read_text()
    cache = SeriesCache()
    for _ in range(2):
        parse_exposition(text.encode(), WANTED_SAMPLES, cache)
    assert cache.shape is not None
    rng = random.Random(filename)
    for _ in range(40):
        variant = relabelled(text, rng) if rng.randrange(2) else revalued(text, rng)
        for body in (text, text, variant):
            expected, malformed = reference_parse(body, WANTED_SAMPLES)
            shaped = cache.shape is not None
            layout = cache.shape
            got = parse_exposition(body.encode(), WANTED_SAMPLES, cache)
            assert (comparable(got.samples), got.malformed_lines) == (comparable(expected), malformed)
            # Read through the shape: its layout says so, and only then (readers key on it).
            assert got.layout is (layout if shaped and cache.shape is layout else None)
        assert shaped  # the variant met the shape of `text`
    for kind in ("auto", "epp", "vllm"):
        check_path([text, revalued(text, rng), relabelled(text, rng), text, revalued(text, rng)], kind)


# Tokens a line may carry after its shape's prefix, and lines without a blank that stand in
# for a picked line (the scan picks lines that start with neither a name character nor '#').
SHAPE_TOKENS = ["0", "12.5", "NaN", "+Inf", "-Inf", "1e3", "1_0", "x", "", "1 2", "\t3", "3\t",
                "\u0663", "0x1", "1\r", " 4"]
STAND_INS = ["9", "1e3", "+7", "-1", ".5", "{}", "\t9", "7 7"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), st.data())
def test_a_body_read_through_a_shape_takes_the_reference_path(body: str, data: st.DataObject) -> None:
    """Once a body's picked lines repeat, the next parse goes through its shape (_Shape: each
    token cut at its line's prefix, all checked and read at once, the samples built per name).
    With plain new values it must take that path; with a line's prefix broken (a line swapped
    for one without a blank: removeprefix leaves it whole) or a token the line loop refuses,
    it must leave it; either way the result equals the reference's."""
    def plain_values(lines: list[str]) -> list[str]:
        return [f"{line.rpartition(' ')[0]} {data.draw(st.integers(0, 99))}" if " " in line else line
                for line in lines]

    # The lines a shape can be made of (canonical, parsed whole), with plain values.
    lines = plain_values([line for line in body.split("\n") if "\\" not in line and _parse_line(line)])
    body = "\n".join(lines)
    cache = SeriesCache()
    for _ in range(2):
        parse_exposition(body.encode(), WANTED_SAMPLES, cache)
    shape = cache.shape
    assume(shape is not None)
    plain = plain_values(lines)
    edited = []
    for line in lines:
        head, blank, _ = line.rpartition(" ")
        edit = data.draw(st.integers(0, 5))
        if edit == 0:
            line = data.draw(st.sampled_from(STAND_INS))
        elif blank and edit < 4:
            line = f"{head} {data.draw(st.sampled_from(SHAPE_TOKENS))}"
        edited.append(line)
    for at, variant in enumerate(("\n".join(plain), "\n".join(edited), body)):
        expected, malformed = reference_parse(variant, WANTED_SAMPLES)
        layout = cache.shape
        got = parse_exposition(variant.encode(), WANTED_SAMPLES, cache)
        # Reads by position first (Exposition.values, entry_values: what the readers with a
        # plan use): the reference's values, and on the shape's path no sample built yet.
        names = [*expected, "no_such_name"]
        by_position = {name: (list(got.values(name)), got.entry_values(name)) for name in names}
        assert got.layout is None or got._shape is not None
        for name, (values, runs) in by_position.items():
            flat = [v for run in runs for v in (run if isinstance(run, list) else [run])]
            assert repr(values) == repr(flat) == repr([value for _, value in expected.get(name, [])])
            written = [e.values if isinstance(e, BucketRun) else e[1] for e in got.entries(name)]
            assert repr(runs) == repr(written)
        assert (comparable(got.samples), got.malformed_lines) == (comparable(expected), malformed)
        assert got.layout is (layout if layout is not None and cache.shape is layout else None)
        if at == 0:
            assert got.layout is shape  # plain new values: the shape's path
            # Keyed by the wanted set's own strings (shared by every target, found by identity).
            assert {id(name) for name in got.names()} <= {id(name) for name in WANTED_SAMPLES}


def test_series_cache_is_bounded_and_keeps_only_the_latest_scrape() -> None:
    cache = SeriesCache(limit=3)
    # Two labels, the first one differing: no line continues a run, each is a series parsed whole.
    rows = [f'llm_d_epp_inflight_requests{{endpoint_name="e{i}",producer_name="p"}} {i}' for i in range(5)]
    first = parse_exposition("\n".join(rows).encode(), WANTED_SAMPLES, cache)
    assert len(first.series("llm_d_epp_inflight_requests")) == 5
    # At most `limit` series, the first seen; a series not in the latest body is gone.
    assert list(cache.series) == [row.rpartition(" ")[0] for row in rows[:3]]
    parse_exposition(rows[4].encode(), WANTED_SAMPLES, cache)
    assert list(cache.series) == [rows[4].rpartition(" ")[0]]
    # A hit shares the cached labels; a parse with another `wanted` starts the cache over.
    again = parse_exposition(rows[4].replace(" 4", " 9").encode(), WANTED_SAMPLES, cache)
    [(labels, value)] = again.series("llm_d_epp_inflight_requests")
    assert (labels, value) == ({"endpoint_name": "e4", "producer_name": "p"}, 9.0)
    assert labels is cache.series[rows[4].rpartition(" ")[0]][1]
    parse_exposition(b"other 1", None, cache)
    assert list(cache.series) == [] and cache.wanted is None


MAX = MAX_EXPOSITION_LINES


@pytest.mark.parametrize("body", [b"", b"\n" * MAX, b"\n" * (MAX + 1), b"a\n" * MAX,
                                  b"a\n" * (MAX + 1) + b"x",
                                  b"x" * (2 * MAX), b"\r\n" * (MAX + 1)])
def test_the_line_count_guard_counts_newlines_as_bytes_count_does(body: bytes) -> None:
    for counted in (body, body.decode()):
        try:
            _refuse_over(counted, MAX_EXPOSITION_LINES)
        except TooManyLines as refused:
            assert str(refused) == f"more than {MAX} lines"
            over = True
        else:
            over = False
        assert over == (body.count(b"\n") > MAX_EXPOSITION_LINES)


SAMPLES_DIR = pathlib.Path(__file__).parent / "data" / "samples"


class CountingScan:
    """The scan of WANTED_SAMPLES, counting its calls (what the line bound's test observes)."""

    def __init__(self) -> None:
        self.real = _scan(WANTED_SAMPLES)
        self.calls = 0

    def findall(self, text: str) -> list[str]:
        self.calls += 1
        assert self.real is not None
        return self.real.findall(text)


def test_the_line_bound_holds_for_a_body_read_through_its_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_EXPOSITION_LINES: a body over it is refused as parse before any line is read one by
    one, except one read through the provider's shape (its picked lines those of the scrape
    before), which reads no more lines than that scrape. Padded to 1 MiB with lines the scan
    leaves out it is read through the shape; with lines it picks, refused right after the scan,
    before the line loop. Without a shape the count comes before the scan. What each case costs
    against the bound's own case: benchmarks/parse.py --line-bound (docs/performance.md)."""
    scan = CountingScan()
    monkeypatch.setattr(exposition_module, "_scan", lambda wanted: scan if wanted is WANTED_SAMPLES else None)
    good = (SAMPLES_DIR / "epp-healthy.prom").read_bytes()
    for pad, refused in ((b"\n", False), (b"a\n", False), (b" \n", True), (b"9\n", True)):
        body = good + pad * ((1 << 20) // len(pad))
        pub = publisher()
        for now in (1.0, 2.0):
            pub.on_scrape(now=now, wall_now=1000.0 + now, body=good, failure_class=None,
                          stale_after_s=10, unavailable=False)
        shape = pub._series.shape
        assert shape is not None
        scan.calls = 0
        if refused:
            with pytest.raises(TooManyLines):
                parse_exposition(body, WANTED_SAMPLES, pub._series, max_lines=MAX)
        else:
            expo = parse_exposition(body, WANTED_SAMPLES, pub._series, max_lines=MAX)
            assert expo._shape is shape and expo.malformed_lines == 0  # no line read one by one
        assert scan.calls == 1
        pub.on_scrape(now=3.0, wall_now=1003.0, body=body, failure_class=None, stale_after_s=10,
                      unavailable=False)
        summary = pub.summary
        if refused:
            assert summary.failures == {"parse": 1}
            assert summary.last_failure_detail == f"more than {MAX} lines"
        else:
            assert summary.failures == {} and pub.last_load is not None
        assert summary.malformed_lines == 0
    # Without a shape (the first scrape) the count comes first, as it always did: no scan.
    pub = publisher()
    scan.calls = 0
    pub.on_scrape(now=1.0, wall_now=1001.0, body=good + b" \n" * (1 << 19), failure_class=None,
                  stale_after_s=10, unavailable=False)
    assert pub.summary.failures == {"parse": 1} and scan.calls == 0


def publisher() -> ProviderPublisher:
    return ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                             publisher_epoch=7, created_at=0.0, next_sequence=iter(range(1, 99)).__next__)


@pytest.mark.parametrize("filename", sorted(p.name for p in SAMPLES_DIR.glob("*.prom")))
def test_reference_samples_take_the_reference_path(filename: str) -> None:
    """Each sample scraped several times with its counters moving (and once going back:
    a reset), in every kind."""
    text = (SAMPLES_DIR / filename).read_text()
    rng = random.Random(filename)
    bodies = []
    for scrape in (0, 1, 2, 3, 1, 2):
        moved = []
        for line in text.split("\n"):
            head, _, value = line.rpartition(" ")
            counter = any(part in head for part in ("_count", "_total", "_bucket"))
            if line and not line.startswith("#") and counter:
                value = repr(float(value) + 3 * scrape)
            moved.append(f"{head} {value}" if head else line)
        bodies.append("\n".join(moved))
    rng.shuffle(bodies[4:])
    for kind in ("auto", "epp", "vllm"):
        check_path(bodies, kind)


TTFT = _EPP_TTFT_BUCKET
ON = f'model_name="{MODEL}",streaming="true"'
OTHER = f'model_name="{MODEL}",streaming="true",x="1"'


def run_of(labels: str, *buckets: tuple[str, str]) -> str:
    """One series' bucket lines, le last."""
    return "\n".join(f'{TTFT}{{{labels},le="{le}"}} {value}' for le, value in buckets)


EDGE_BODIES = {
    "nan-count": [run_of(ON, ("0.5", "1"), ("+Inf", "NaN")), run_of(ON, ("0.5", "2"), ("+Inf", "4"))],
    "same-bound-twice": [run_of(ON, ("1", "1"), ("1.0", "2"), ("+Inf", "3"))] * 2,
    # Two series: every NaN bound is a bound of its own, bucket by bucket.
    "nan-bound": ["\n".join([run_of(ON, ("NaN", "1"), ("+Inf", "3")),
                             run_of(OTHER, ("NaN", "1"), ("+Inf", "2"))])] * 2,
    "interrupted-run": [run_of(ON, ("0.5", "1"), ("1", "2 17"), ("+Inf", "3"))] * 2,
    "other-layouts": [
        "\n".join([run_of(ON, ("0.5", "1"), ("+Inf", "3")), run_of(OTHER, ("0.25", "1"), ("+Inf", "2"))]),
        "\n".join([run_of(ON, ("0.5", "2"), ("+Inf", "5")), run_of(OTHER, ("0.25", "2"), ("+Inf", "4"))]),
    ],
    "le-not-last": [f'{TTFT}{{le="0.5",{ON}}} 1\n{TTFT}{{le="+Inf",{ON}}} 3'] * 2,
}


@pytest.mark.parametrize("name", sorted(EDGE_BODIES))
def test_bucket_edge_cases_take_the_reference_path(name: str) -> None:
    """Bucket runs that the summing shortcut must leave to the bucket-by-bucket loop."""
    for kind in ("auto", "epp"):
        check_path(EDGE_BODIES[name], kind)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0, 5.0]),
                          st.one_of(st.integers(-3, 50).map(float), st.sampled_from([math.nan, math.inf]))),
                max_size=6),
       st.sampled_from([0.0, 0.25, 0.5, 0.9, 0.99, 1.0]), st.booleans())
def test_histogram_quantile_matches_the_bucket_by_bucket_reference(pairs, q: float, inf_last: bool) -> None:
    """Dips, NaN and infinite counts, zero and repeated bounds, no +Inf bucket."""
    buckets = tuple(sorted(pairs)) + (((math.inf, 40.0),) if inf_last else ())

    def outcome(quantile: Callable[[float, tuple], float | None]) -> str:
        try:
            return repr(quantile(q, buckets))
        # q = 0 on an empty first bucket divides 0 by 0; a NaN rank (0 * an infinite total)
        # is reached by no bucket. Both the same, exception for exception.
        except (ZeroDivisionError, StopIteration) as error:
            return type(error).__name__

    assert outcome(histogram_quantile) == outcome(_quantile)


@pytest.mark.parametrize("kind", ["auto", "vllm"])
def test_a_nan_bucket_bound_reads_as_a_new_layout_on_every_scrape(kind: str) -> None:
    # Found by the test above (hypothesis): each scrape's NaN bound equals no bound before it,
    # so the reference sees a layout change (a reset) every time; a bound kept per layout
    # must not make it compare equal.
    body = 'vllm:time_to_first_token_seconds_bucket{le="NaN"} 0'
    check_path([body, body.replace(" 0", " 1"), body.replace(" 0", " 2"), body.replace(" 0", " 3")], kind)
