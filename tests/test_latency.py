"""Latency window (gridd.core.latency): deltas, quantiles, threshold, resets, sliding.

Expositions are built in the tests so every delta is known; expected figures carry their
arithmetic.
"""

from __future__ import annotations

import math

import pytest

from gridd.core.derivation import WANTED_SAMPLES
from gridd.core.exposition import parse_exposition
from gridd.core.latency import LatencyWindow, histogram_quantile
from gridd.core.readings import LatencyBlock

M = 'model_name="m",target_model_name="m"'
LES = ("0.1", "0.2", "0.4", "+Inf")


def epp(*, successes: float = 0, errors: float = 0, bad_requests: float = 0,
        ttft_a: tuple[float, ...] = (0, 0, 0, 0), ttft_b: tuple[float, ...] = (0, 0, 0, 0),
        ttft_non_streaming: tuple[float, ...] = (0, 0, 0, 0),
        tpot_sum: float = 0, tpot_count: float = 0):
    """An EPP exposition: two streaming flows (a, b) and one non-streaming series."""
    lines = [
        # Two flows share the success count; put all of it on flow a.
        f'llm_d_epp_request_duration_seconds_count{{fairness_id="a",{M},priority="0"}} {successes}',
        f'llm_d_epp_request_duration_seconds_count{{fairness_id="b",{M},priority="0"}} 0',
        f'llm_d_epp_request_error_total{{error_code="ModelServerError",fairness_id="a",{M},'
        f'priority="0"}} {errors}',
        f'llm_d_epp_request_error_total{{error_code="BadRequest",fairness_id="a",model_name="",priority="0",'
        f'target_model_name=""}} {bad_requests}',
        f'llm_d_epp_request_streaming_tpot_seconds_sum{{fairness_id="a",{M},priority="0"}} {tpot_sum}',
        f'llm_d_epp_request_streaming_tpot_seconds_count{{fairness_id="a",{M},priority="0"}} {tpot_count}',
    ]
    for flow, streaming, counts in (("a", "true", ttft_a), ("b", "true", ttft_b),
                                    ("a", "false", ttft_non_streaming)):
        for le, count in zip(LES, counts, strict=True):
            lines.append(f'llm_d_epp_request_ttft_seconds_bucket{{fairness_id="{flow}",{M},priority="0",'
                         f'streaming="{streaming}",le="{le}"}} {count}')
    return parse_exposition("\n".join(lines) + "\n", WANTED_SAMPLES)


def test_block_from_two_scrapes_30s_apart():
    window = LatencyWindow()
    base = epp(successes=1000, errors=10, bad_requests=7,
               ttft_a=(100, 200, 300, 310), ttft_b=(50, 60, 70, 80),
               ttft_non_streaming=(0, 0, 0, 5), tpot_sum=10.0, tpot_count=500)
    assert window.observe(100.0, base) is None  # no baseline yet
    # Streaming deltas: flow a (6, 20, 25, 26), flow b (4, 10, 13, 14); summed per le
    # -> cumulative (10, 30, 38, 40). The non-streaming series jumps by 1000 in its lowest
    # bucket and must not pull the quantiles down.
    cur = epp(successes=1045, errors=15, bad_requests=107,
              ttft_a=(106, 220, 325, 336), ttft_b=(54, 70, 83, 94),
              ttft_non_streaming=(1000, 1000, 1000, 1005), tpot_sum=11.2, tpot_count=540)
    block = window.observe(130.0, cur)
    assert block is not None
    assert block.window_s == 30.0
    # completed = successes 1045 - 1000 = 45, + failures 15 - 10 = 5 -> 50. The 100 new
    # BadRequest rows with model_name="" (unparseable bodies) are not requests for a model.
    assert block.completed == 50
    assert block.error_ratio == pytest.approx(0.1, abs=1e-15)  # 5 / 50
    # p50: rank 0.5 x 40 = 20 -> first cumulative >= 20 is le 0.2 (30); below 10 (le 0.1);
    #      0.1 + (0.2 - 0.1) x (20 - 10) / (30 - 10) = 0.1 + 0.1 x 0.5 = 0.15
    assert block.ttft_p50_s == pytest.approx(0.15, abs=1e-15)
    # p90: rank 0.9 x 40 = 36 -> le 0.4 (38); below 30 (le 0.2);
    #      0.2 + (0.4 - 0.2) x (36 - 30) / (38 - 30) = 0.2 + 0.2 x 0.75 = 0.35
    assert block.ttft_p90_s == pytest.approx(0.35, abs=1e-15)
    # tpot: (11.2 - 10.0) / (540 - 500) = 1.2 / 40 = 0.03
    assert block.tpot_s == pytest.approx(0.03, abs=1e-15)


@pytest.mark.parametrize(("completed", "expect_block"), [(19, False), (20, True)])
def test_min_completed_threshold(completed, expect_block):
    window = LatencyWindow(window_s=30.0, min_completed=20)
    window.observe(0.0, epp(successes=100, errors=0))
    # 15 successes + (completed - 15) failures
    block = window.observe(30.0, epp(successes=115, errors=completed - 15))
    if expect_block:
        assert block == LatencyBlock(window_s=30.0, completed=20, ttft_p50_s=None, ttft_p90_s=None,
                                     tpot_s=None, error_ratio=0.25)  # 5 failed / 20
    else:
        assert block is None


def test_rank_in_inf_bucket_returns_last_finite_bound():
    window = LatencyWindow(min_completed=1)
    window.observe(0.0, epp())
    # Cumulative deltas (10, 10, 15, 20): p90 rank 18 > 15 lands in +Inf -> 0.4.
    # p50 rank 10 -> le 0.1 (10): 0 + 0.1 x 10 / 10 = 0.1.
    block = window.observe(30.0, epp(successes=20, ttft_a=(10, 10, 15, 20)))
    assert block is not None
    assert block.ttft_p90_s == 0.4
    assert block.ttft_p50_s == 0.1


def test_histogram_quantile_rules():
    inf = math.inf
    assert histogram_quantile(0.5, ((0.1, 0.0), (inf, 0.0))) is None  # no observations
    assert histogram_quantile(0.5, ((0.1, 3.0),)) is None  # no +Inf bucket
    # Non-monotonic input is made monotonic first: (4, 3, 8) -> (4, 4, 8); p50 rank 4 -> le 1.
    assert histogram_quantile(0.5, ((1.0, 4.0), (2.0, 3.0), (inf, 8.0))) == 1.0
    # p25 rank 1 of (2, 4, 4) -> le 1: 0 + 1 x 1 / 2 = 0.5
    assert histogram_quantile(0.25, ((1.0, 2.0), (2.0, 4.0), (inf, 4.0))) == 0.5


def test_whole_history_of_healthy_sample(samples_dir):
    """From a freshly started EPP (no series yet) to the healthy sample, 30 s later."""
    window = LatencyWindow()
    window.observe(0.0, parse_exposition("", WANTED_SAMPLES))
    expo = parse_exposition((samples_dir / "epp-healthy.prom").read_bytes(), WANTED_SAMPLES)
    block = window.observe(30.0, expo)
    assert block is not None
    # successes = duration counts 1490 + 339 = 1829; failures: ModelServerError 1 (the 3
    # BadRequest with model_name="" excluded) -> completed 1830, error ratio 1 / 1830.
    assert block.completed == 1830
    assert block.error_ratio == pytest.approx(1 / 1830, rel=1e-12)
    # Streaming TTFT buckets, default-flow + team-a: le 0.1: 369 + 120 = 489,
    # le 0.2: 891 + 240 = 1131, le 0.4: 1306 + 322 = 1628, +Inf: 1440 + 339 = 1779
    # (the 50 streaming="false" observations are left out).
    # p50: rank 889.5 -> le 0.2: 0.1 + 0.1 x (889.5 - 489) / (1131 - 489) = 0.1 + 0.1 x 400.5 / 642
    assert block.ttft_p50_s == pytest.approx(0.1 + 0.1 * 400.5 / 642, rel=1e-12)
    # p90: rank 1601.1 -> le 0.4: 0.2 + 0.2 x (1601.1 - 1131) / (1628 - 1131) = 0.2 + 0.2 x 470.1 / 497
    assert block.ttft_p90_s == pytest.approx(0.2 + 0.2 * 470.1 / 497, rel=1e-12)
    # tpot: (31.148768 + 7.055843) / (1440 + 339) = 38.204611 / 1779
    assert block.tpot_s == pytest.approx(38.204611 / 1779, rel=1e-12)


def test_counter_reset_starts_the_window_over():
    window = LatencyWindow(min_completed=20)
    window.observe(0.0, epp(successes=1000))
    block = window.observe(10.0, epp(successes=1030))
    assert block is not None and (block.window_s, block.completed) == (10.0, 30)
    # EPP restart: 1030 -> 5. History dropped; this scrape is the new baseline.
    assert window.observe(20.0, epp(successes=5)) is None
    assert window.resets == 1
    # 30 - 5 = 25 since the restart, over 10 s (not 30 - 1000 over 30 s).
    block = window.observe(30.0, epp(successes=30))
    assert block is not None and (block.window_s, block.completed) == (10.0, 25)


def test_a_falling_bucket_is_a_reset():
    window = LatencyWindow(min_completed=1)
    window.observe(0.0, epp(successes=50, ttft_a=(5, 6, 7, 8)))
    assert window.observe(1.0, epp(successes=60, ttft_a=(4, 6, 7, 8))) is None
    assert window.resets == 1


def test_window_slides_and_keeps_only_one_window():
    window = LatencyWindow(window_s=30.0, min_completed=1)
    # A success every second, scraped every 10 s.
    blocks = {t: window.observe(float(t), epp(successes=t)) for t in (0, 10, 20, 30, 40)}
    assert blocks[0] is None
    # At 10: baseline 0 (the oldest held; window not yet full) -> 10 over 10 s.
    assert (blocks[10].window_s, blocks[10].completed) == (10.0, 10)
    # At 30: baseline is the oldest snapshot at or after 30 - 30 = 0 -> t=0 (inclusive).
    assert (blocks[30].window_s, blocks[30].completed) == (30.0, 30)
    # At 40: t=0 < 40 - 30 is dropped; baseline t=10 -> 40 - 10 = 30 over 30 s.
    assert (blocks[40].window_s, blocks[40].completed) == (30.0, 30)
    assert window.snapshots_held == 4  # 10, 20, 30, 40
    # Off-grid scrape at 45: t=10 < 15 dropped; baseline t=20 -> 45 - 20 = 25 over 25 s.
    block = window.observe(45.0, epp(successes=45))
    assert (block.window_s, block.completed) == (25.0, 25)
    assert window.snapshots_held == 4  # 20, 30, 40, 45


def test_scrape_gap_longer_than_window_leaves_no_baseline():
    window = LatencyWindow(min_completed=1)
    window.observe(0.0, epp(successes=0))
    assert window.observe(31.0, epp(successes=100)) is None
    assert window.snapshots_held == 1
    block = window.observe(32.0, epp(successes=130))
    assert (block.window_s, block.completed) == (1.0, 30)


def test_engine_answer_is_a_success_increase_between_two_scrapes():
    window = LatencyWindow()
    window.observe(0.0, epp(successes=10))
    assert not window.answered_on_last_observe  # nothing to compare with
    window.observe(1.0, epp(successes=10, errors=3))  # only failures: no answer
    assert not window.answered_on_last_observe
    assert not window.engine_answered_within(1.0)
    window.observe(2.0, epp(successes=11, errors=3))  # 10 -> 11: answered, at the later scrape
    assert window.answered_on_last_observe
    assert window.last_answer_at == 2.0
    window.observe(3.0, epp(successes=11, errors=3))
    assert not window.answered_on_last_observe
    assert window.engine_answered_within(32.0)  # 32 - 2 = 30 <= 30: inclusive
    assert not window.engine_answered_within(32.5)
    assert window.engine_answered_within(12.0, within_s=10.0)


def test_reset_is_not_an_engine_answer():
    window = LatencyWindow()
    window.observe(0.0, epp(successes=500))
    window.observe(1.0, epp(successes=3))  # restart: the 3 cannot be dated
    assert not window.answered_on_last_observe
    assert window.last_answer_at is None


def test_dual_emission_is_not_counted_twice():
    def both(successes: float, errors: float):
        text = (f'llm_d_epp_request_duration_seconds_count{{{M}}} {successes}\n'
                f'inference_objective_request_duration_seconds_count{{{M}}} {successes}\n'
                f'llm_d_epp_request_error_total{{error_code="Internal",{M}}} {errors}\n'
                f'inference_objective_request_error_total{{error_code="Internal",{M}}} {errors}\n')
        return parse_exposition(text, WANTED_SAMPLES)

    window = LatencyWindow()
    window.observe(0.0, both(0, 0))
    block = window.observe(30.0, both(18, 2))
    assert (block.completed, block.error_ratio) == (20, 0.1)  # 18 + 2, 2 / 20


def test_legacy_only_epp_gives_counts_but_no_ttft():
    def legacy(successes: float, errors: float):
        text = (f'inference_objective_request_duration_seconds_count{{{M}}} {successes}\n'
                f'inference_objective_request_error_total{{error_code="Internal",{M}}} {errors}\n')
        return parse_exposition(text, WANTED_SAMPLES)

    window = LatencyWindow()
    window.observe(0.0, legacy(100, 0))
    block = window.observe(30.0, legacy(124, 1))
    assert block == LatencyBlock(window_s=30.0, completed=25, error_ratio=0.04)  # 1 / 25


def vllm(*, stop: float, abort: float, ttft: tuple[float, ...], tpot_sum: float, tpot_count: float):
    lines = [
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {stop}',
        f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="m"}} {abort}',
        f'vllm:request_time_per_output_token_seconds_sum{{engine="0",model_name="m"}} {tpot_sum}',
        f'vllm:request_time_per_output_token_seconds_count{{engine="0",model_name="m"}} {tpot_count}',
        # The per-token ITL histogram is only a fallback and must not be used here.
        'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 999.0',
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 1.0',
    ]
    for le, count in zip(("0.02", "0.04", "0.06", "+Inf"), ttft, strict=True):
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} '
                     f'{count}')
    return parse_exposition("\n".join(lines) + "\n", WANTED_SAMPLES)


def test_vllm_direct_latency():
    window = LatencyWindow()
    window.observe(0.0, vllm(stop=100, abort=5, ttft=(10, 50, 100, 105), tpot_sum=2.0, tpot_count=100))
    block = window.observe(30.0, vllm(stop=118, abort=7, ttft=(14, 64, 118, 125),
                                      tpot_sum=2.5, tpot_count=120))
    assert block is not None
    # completed: all finished requests, stop 18 + abort 2 = 20.
    assert block.completed == 20
    # No failure count in vLLM's engine metrics.
    assert block.error_ratio is None
    # TTFT deltas (4, 14, 18, 20): p50 rank 10 -> le 0.04: 0.02 + 0.02 x (10 - 4) / (14 - 4) = 0.032
    assert block.ttft_p50_s == pytest.approx(0.032, abs=1e-15)
    # p90 rank 18 -> le 0.06 (18): 0.04 + 0.02 x (18 - 14) / (18 - 14) = 0.06
    assert block.ttft_p90_s == pytest.approx(0.06, abs=1e-15)
    # tpot per request: (2.5 - 2.0) / (120 - 100) = 0.025
    assert block.tpot_s == pytest.approx(0.025, abs=1e-15)
    assert window.answered_on_last_observe  # stop 100 -> 118


def test_vllm_abort_alone_is_not_an_engine_answer():
    window = LatencyWindow()
    args = dict(ttft=(0, 0, 0, 0), tpot_sum=0.0, tpot_count=0)
    window.observe(0.0, vllm(stop=10, abort=0, **args))
    window.observe(1.0, vllm(stop=10, abort=4, **args))
    assert not window.answered_on_last_observe
    assert window.last_answer_at is None


def test_vllm_sample_file_is_read_as_vllm(samples_dir):
    body = (samples_dir / "vllm-direct.prom").read_text()
    window = LatencyWindow()
    window.observe(0.0, parse_exposition("", WANTED_SAMPLES))
    # A source switch (empty EPP reading -> vLLM) starts over.
    assert window.observe(1.0, parse_exposition(body, WANTED_SAMPLES)) is None
    assert window.resets == 1
    bumped = body.replace('finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1702.0',
                          'finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1722.0')
    block = window.observe(2.0, parse_exposition(bumped, WANTED_SAMPLES))
    # 1722 - 1702 = 20 completed; TTFT and TPOT counts did not move.
    assert block == LatencyBlock(window_s=1.0, completed=20)


def test_constructor_rejects_bad_knobs():
    with pytest.raises(ValueError):
        LatencyWindow(window_s=0)
    with pytest.raises(ValueError):
        LatencyWindow(min_completed=0)


@pytest.mark.parametrize("les", [("0.4", "0.1", "+Inf", "0.2"), ("+Inf", "0.4", "0.2", "0.1"), LES])
def test_buckets_listed_out_of_order_are_summed_in_bound_order(les: tuple[str, ...]):
    """A histogram whose le lines come in any order (here both streaming flows alike) sums
    per bound, in bound order: read by label, and through the kept plan of a layout."""
    from gridd.core.exposition import SeriesCache
    from gridd.core.latency import _EPP_TTFT_BUCKET, _buckets, latency_plan

    counts = {"0.1": 1, "0.2": 3, "0.4": 6, "+Inf": 10}
    lines = [f'llm_d_epp_request_ttft_seconds_bucket{{fairness_id="{flow}",{M},priority="0",'
             f'streaming="true",le="{le}"}} {counts[le] * scale}'
             for flow, scale in (("a", 1), ("b", 2)) for le in les]
    body = ("\n".join(lines) + "\n").encode()
    cache = SeriesCache()
    for _ in range(2):  # the series kept, then the shape of the body
        parse_exposition(body, WANTED_SAMPLES, cache)
    expo = parse_exposition(body, WANTED_SAMPLES, cache)
    assert expo.layout is not None  # the repeated body is read through its layout
    expected = ((0.1, 0.2, 0.4, math.inf), (3.0, 9.0, 18.0, 30.0))
    assert _buckets(expo, _EPP_TTFT_BUCKET, frozenset({"m"}), streaming_only=True) == expected
    plan = latency_plan(expo, kind="epp", models=frozenset({"m"}))
    assert plan is not None
    snapshot = plan.snapshot(0.0, expo)
    assert (snapshot.ttft_bounds, snapshot.ttft_counts) == expected
    # The same layout with its runs written out as samples (a reader called series()): the
    # plan's positions among runs no longer apply, and the plain read takes over.
    again = parse_exposition(body, WANTED_SAMPLES, cache)
    assert again.layout is expo.layout and len(again.series(_EPP_TTFT_BUCKET)) == 2 * len(les)
    snapshot = plan.snapshot(1.0, again)
    assert (snapshot.ttft_bounds, snapshot.ttft_counts) == expected


def test_counters_summing_past_floats_give_no_block_rather_than_a_crash():
    """Finite counts whose sum overflows to inf (then inf - inf = NaN across the window): no
    completed count can be published, so no latency block (it crashed on int(round(inf)))."""
    def expo(values: tuple[str, ...]):
        lines = [f'llm_d_epp_request_duration_seconds_count{{n="{i}"}} {v}' for i, v in enumerate(values)]
        return parse_exposition("\n".join(lines) + "\n", WANTED_SAMPLES)

    window = LatencyWindow(window_s=1.5, kind="auto", min_completed=1)
    assert window.observe(0.0, expo(("0", "0"))) is None
    assert window.observe(1.0, expo(("1e308", "1e308"))) is None  # 0 to inf
    assert window.observe(2.0, expo(("1e308", "1e308"))) is None  # inf - inf
    assert window.observe(3.0, expo(("5", "5"))) is None  # a counter went down: a reset
    assert window.observe(4.0, expo(("6", "7"))) is not None  # and it reads again
