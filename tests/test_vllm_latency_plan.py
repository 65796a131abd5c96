"""VllmLatencyPlan (the latency window's TTFT bucket reads of a vLLM source, kept per
Exposition.layout) against the plain _snapshot, on generated vLLM bodies: several engines
and models, ``le`` last (runs) or in the middle (bucket lines, as tests/data/samples/
vllm-direct.prom), odd ``le`` texts (missing, not a number, NaN, -0 next to 0, one bound
spelt twice), NaN / negative / infinite counts, and bodies whose labels change mid-way.
Snapshots are compared by repr, so a -0.0 or NaN difference counts."""

from __future__ import annotations

import math
import pathlib
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gridd.core.latency as latency
from gridd.core.derivation import WANTED_SAMPLES
from gridd.core.exposition import BucketRun, Exposition, SeriesCache, parse_exposition
from gridd.core.latency import LatencyPlan, LatencyWindow, VllmLatencyPlan, _snapshot, latency_plan

SAMPLE = (pathlib.Path(__file__).parent / "data" / "samples" / "vllm-direct.prom").read_text()
TTFT = "vllm:time_to_first_token_seconds_bucket"
ODD_LES = ["abc", "NaN", "-0", "0", "1e-3", "0.001", "+Inf", "2.5"]
ODD_COUNTS = [math.nan, -1.0, math.inf, -math.inf, -0.0, 1e308]


def token(value: float) -> str:
    return "NaN" if math.isnan(value) else "+Inf" if value == math.inf else "-Inf" if value == -math.inf \
        else repr(value)


def vllm_body(engines: int, models: int, les: list[str | None], le_last: bool,
              values: list[float], rng: random.Random) -> str:
    """A vLLM /metrics body: per engine x model, success counters by finished_reason, TPOT
    sum/count, the gauges, and TTFT buckets with ``les`` (None: a line without ``le``)."""
    lines = []
    counts = iter(values)
    for engine in range(engines):
        for model in range(models):
            base = f'engine="{engine}",model_name="m{model}"'
            for reason in ("stop", "abort", "length"):
                lines.append(f'vllm:request_success_total{{{base},finished_reason="{reason}"}} '
                             f"{rng.randrange(100)}.0")
            lines.append(f"vllm:request_time_per_output_token_seconds_sum{{{base}}} {rng.random()}")
            lines.append(f"vllm:request_time_per_output_token_seconds_count{{{base}}} {rng.randrange(9)}.0")
            lines.append(f"vllm:num_requests_running{{{base}}} {rng.randrange(9)}.0")
            for le in les:
                if le is None:
                    labels = base
                elif le_last:
                    labels = f'{base},le="{le}"'
                else:
                    labels = f'engine="{engine}",le="{le}",model_name="m{model}"'
                lines.append(f"{TTFT}{{{labels}}} {token(next(counts))}")
    return "\n".join(lines) + "\n"


# A body's shape (engines, models, le texts, le last, seed of its values): its layout.
LES = st.one_of(
    # A histogram's bounds (vLLM's own: distinct, ending at +Inf), or odd le texts.
    st.lists(st.sampled_from(["0.001", "0.01", "0.1", "1", "10"]), unique=True).map(
        lambda les: [*les, "+Inf"]),
    st.lists(st.one_of(st.none(), st.sampled_from(ODD_LES)), min_size=0, max_size=6))
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 2), LES, st.booleans(), st.integers(0, 2**32))


def parsed(body: str, cache: SeriesCache) -> Exposition:
    return parse_exposition(body.encode(), WANTED_SAMPLES, cache)


def planned(body: str, cache: SeriesCache) -> Exposition:
    """``body`` parsed as the third scrape of its lines (the first two learn their series and
    their shape: no layout yet)."""
    parsed(body, cache)
    parsed(body, cache)
    expo = parsed(body, cache)
    assert expo.layout is not None
    return expo


def values_for(rng: random.Random, n: int, odd: float) -> list[float]:
    return [rng.choice(ODD_COUNTS) if rng.random() < odd else float(rng.randrange(50)) for _ in range(n)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SHAPES, st.sampled_from(["auto", "vllm"]))
def test_the_plan_snapshots_as_the_plain_path(shape: tuple[object, ...], kind: str) -> None:
    engines, models, les, le_last, seed = shape
    assert isinstance(engines, int) and isinstance(models, int) and isinstance(les, list)
    assert isinstance(le_last, bool) and isinstance(seed, int)
    rng = random.Random(seed)
    n = engines * models * len(les)
    cache = SeriesCache()
    first = planned(vllm_body(engines, models, les, le_last, values_for(rng, n, 0.0), rng), cache)
    plan = latency_plan(first, kind=kind, models=frozenset({"m0"}))
    assert isinstance(plan, VllmLatencyPlan)
    for scrape in range(6):
        expo = parsed(vllm_body(engines, models, les, le_last, values_for(rng, n, 0.3 * (scrape % 2)), rng),
                      cache)
        assert expo.layout is first.layout  # same names and labels: the plan holds
        assert repr(plan.snapshot(float(scrape), expo)) == repr(
            _snapshot(float(scrape), expo, kind=kind, models=frozenset({"m0"})))


def test_the_sample_reads_its_bucket_lines_through_the_plan_without_the_plain_sums() -> None:
    cache = SeriesCache()
    first = planned(SAMPLE, cache)
    plan = VllmLatencyPlan(first)
    assert plan.slots is not None and plan.ttft_layout is None  # le in the middle: bucket lines
    rng = random.Random(1)
    with mock.patch.object(latency, "_buckets", side_effect=AssertionError("plain path")):
        for _ in range(3):
            body = "\n".join(line.rpartition(" ")[0] + f" {rng.randrange(99)}.0" if line.startswith(TTFT)
                             else line for line in SAMPLE.split("\n"))
            expo = parsed(body, cache)
            assert expo.layout is first.layout
            snap = plan.snapshot(0.0, expo)
            assert snap.ttft_bounds[-1] == math.inf and len(snap.ttft_counts) == len(snap.ttft_bounds)


@pytest.mark.parametrize("le_last", [True, False])
def test_runs_and_lines_take_their_fast_reads(le_last: bool) -> None:
    """Runs (le last) go through the shared bucket layout, lines through the slots; neither
    calls the plain _buckets while no count is NaN."""
    rng = random.Random(2)
    les: list[str | None] = ["0.1", "1", "+Inf"]
    cache = SeriesCache()
    body = vllm_body(2, 2, les, le_last, values_for(rng, 12, 0.0), rng)
    first = planned(body, cache)
    plan = VllmLatencyPlan(first)
    assert any(isinstance(entry, BucketRun) for entry in first.entries(TTFT)) == le_last
    assert (plan.ttft_layout is not None) == le_last and (plan.slots is not None) != le_last
    expo = parsed(vllm_body(2, 2, les, le_last, values_for(rng, 12, 0.0), rng), cache)
    with mock.patch.object(latency, "_buckets", side_effect=AssertionError("plain path")):
        fast = plan.snapshot(1.0, expo)
    assert repr(fast) == repr(_snapshot(1.0, expo, kind="vllm"))


def test_an_epp_source_keeps_its_latency_plan_and_a_window_plans_a_vllm_source() -> None:
    cache = SeriesCache()
    expo = planned(SAMPLE, cache)
    assert isinstance(latency_plan(expo, kind="epp", models=None), LatencyPlan)
    window = LatencyWindow(kind="auto")
    window.observe(0.0, expo)
    assert isinstance(window._plan, VllmLatencyPlan)  # noqa: SLF001  # which plan the window keeps
