"""Gateway strategies on probe metadata (spec 004; gridd/core/strategy.py, docs/strategies.md):
bounds drop, missing values are kept and sorted last, the grid's exclusions come first, a value
older than the signal TTL is missing, every healthy candidate over a bound is a 503, and the
explain chances are the exact chances of the pick."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from support import WALL, BatchFeed

from gridd.core.decisions import Forward, Unavailable, UnknownModel
from gridd.core.knobs import RoutingKnobs
from gridd.core.ordering import CandidateView, build_snapshot
from gridd.core.readings import BatchOrder
from gridd.core.store import GatewayStore
from gridd.core.strategy import (
    CandidateRank,
    Strategy,
    StrategyTable,
    explain_strategy,
    fresh_values,
    strategy_pick,
)
from gridd.wire import Batch, LocalProvider, ServingConfig, SiteIngress

WAITING = "performance.num_requests_waiting"
# Spec 004's strategy.yaml.
PERF = Strategy.of("performance_based",
                   {"performance": {"num_requests_waiting": 5, "kv_cache_usage_perc": 0.9}},
                   [(WAITING, False)])
SERVING = ServingConfig(
    providers=(LocalProvider("llama", "m", "http://a-llama/v1"), LocalProvider("probed", "m", "http://a-p/v1")),
    ingresses=(SiteIngress("b", "http://b-gw"), SiteIngress("c", "http://c-gw")),
)


def view(site: str, *, capacity: float = 8.0, rho: float = 0.5, healthy: bool = True) -> CandidateView:
    return CandidateView(site=site, provider="p", model="m", capacity=capacity, rho=rho, healthy=healthy)


def values_of(table: dict[str, dict[str, float]]):
    return lambda v: table.get(v.site, {})


def test_a_value_over_a_bound_drops_and_a_missing_value_is_kept_and_sorted_last():
    snap = build_snapshot("m", [view("a", rho=0.1), view("b"), view("c"), view("d"), view("e")])
    values = values_of({"a": {WAITING: 6.0}, "b": {WAITING: 2.0}, "c": {WAITING: 0.0},
                        "d": {"performance.kv_cache_usage_perc": 0.95}})
    ranks = explain_strategy(snap, PERF, values, rule="strict")
    assert [(r.site, r.verdict, r.reason, r.keys, r.position, r.chance) for r in ranks] == [
        ("c", "kept", "", (0.0,), 1, 1.0),
        ("b", "kept", "", (2.0,), 2, 0.0),
        ("e", "kept", "", (None,), 3, 0.0),  # no value: kept, after every candidate with one
        ("a", "dropped", f"{WAITING}=6 > 5", (6.0,), None, 0.0),
        ("d", "dropped", "performance.kv_cache_usage_perc=0.95 > 0.9", (None,), None, 0.0),
    ]
    for seed in range(20):
        assert strategy_pick(snap, random.Random(seed), PERF, values, rule="strict").site == "c"


def test_descending_keys_in_order_and_missing_last_whichever_the_direction():
    strategy = Strategy.of("s", {}, [("x", True), ("y", False)])
    snap = build_snapshot("m", [view("a"), view("b"), view("c"), view("d")])
    values = values_of({"a": {"x": 1.0, "y": 5.0}, "b": {"x": 3.0}, "c": {"x": 1.0, "y": 2.0},
                        "d": {"y": 0.0}})
    ranks = explain_strategy(snap, strategy, values, rule="strict")
    assert [r.site for r in ranks] == ["b", "c", "a", "d"]


def test_ties_fall_to_the_grids_order():
    snap = build_snapshot("m", [view("a", rho=0.9), view("b", rho=0.2)])
    values = values_of({"a": {WAITING: 1.0}, "b": {WAITING: 1.0}})
    assert strategy_pick(snap, random.Random(1), PERF, values, rule="strict").site == "b"  # the less loaded


def test_two_choices_chances_are_exact_and_match_the_pick():
    # Equal capacities, three kept: the best wins every pair it is drawn in (2 of 3 pairs).
    snap = build_snapshot("m", [view("a"), view("b"), view("c")])
    values = values_of({"a": {WAITING: 3.0}, "b": {WAITING: 1.0}, "c": {WAITING: 2.0}})
    chances = {r.site: r.chance for r in explain_strategy(snap, PERF, values)}
    assert chances == pytest.approx({"b": 2 / 3, "c": 1 / 3, "a": 0.0})
    rng = random.Random(5)
    picks = Counter(strategy_pick(snap, rng, PERF, values).site for _ in range(30_000))
    assert picks["a"] == 0
    assert abs(picks["b"] / 30_000 - 2 / 3) < 0.015


def test_excluded_candidates_are_never_filtered_ranked_or_picked():
    snap = build_snapshot("m", [view("a", healthy=False), view("b")])
    values = values_of({"a": {WAITING: 0.0}, "b": {WAITING: 4.0}})
    assert strategy_pick(snap, random.Random(1), PERF, values).site == "b"
    assert explain_strategy(snap, PERF, values)[-1] == CandidateRank("a", "p", "excluded",
                                                                     reason="excluded by the grid")


def test_a_probe_value_older_than_the_ttl_is_missing():
    probes = {WAITING: 1.0, "probe.x": 2.0}
    # batch 15 s old; x was produced 6 s before the batch's sample: 21 s > TTL 20
    assert fresh_values(probes, {"probe.x": 6.0}, 15.0, 20.0) == {WAITING: 1.0}
    assert fresh_values(probes, {"probe.x": 5.0}, 15.0, 20.0) == probes  # exactly the TTL: fresh
    assert fresh_values(probes, {}, 20.5, 20.0) == {}


# -- through the store ---------------------------------------------------------------------------


def strategy_store(pick_rule: str = "two_choices", **table) -> GatewayStore:
    strategies = StrategyTable(PERF, pick_rule=pick_rule, **table)
    s = GatewayStore(site="a", knobs=RoutingKnobs(strategies=strategies))
    s.set_serving(SERVING)
    return s


def with_probes(batch: Batch, probes: dict[str, float], ages: dict[str, float] | None = None) -> Batch:
    import msgspec

    return msgspec.structs.replace(batch, probes=probes, probe_age_s=ages or {})


def picks(s: GatewayStore, now: float, n: int = 300) -> Counter:
    rng = random.Random(3)
    out: Counter = Counter()
    for _ in range(n):
        d = s.decide("m", now=now, rng=rng)
        assert isinstance(d, Forward), d
        out[d.site] += 1
    return out


def test_store_a_site_over_the_bound_gets_nothing_and_all_over_is_503():
    s, feed = strategy_store(), BatchFeed()
    s.ingest([with_probes(feed.batch("a"), {WAITING: 7.0}), with_probes(feed.batch("b"), {WAITING: 1.0}),
              with_probes(feed.batch("c"), {WAITING: 2.0})], now=0.0, now_wall=WALL)
    # a is over the bound; of the two kept, two choices always draws both: the lower queue
    assert set(picks(s, 0.0)) == {"b"}
    s.ingest([with_probes(feed.batch(x), {WAITING: 9.0}) for x in "abc"], now=1.0, now_wall=WALL)
    assert s.decide("m", now=1.0, rng=random.Random(1)) == Unavailable(5.0, cause="strategy")
    assert isinstance(s.decide("other", now=1.0, rng=random.Random(1)), UnknownModel)  # 404 keeps its meaning


def test_store_excluded_wins_over_the_best_value():
    s, feed = strategy_store("strict"), BatchFeed()
    s.ingest([with_probes(feed.batch("a", ready=False), {WAITING: 0.0}),
              with_probes(feed.batch("b"), {WAITING: 4.0})], now=0.0, now_wall=WALL)
    assert set(picks(s, 0.0)) == {"b"}  # a has the best value but is not ready


def test_store_values_are_read_at_the_pick_and_age_out_at_the_ttl():
    s, feed = strategy_store("strict"), BatchFeed()
    # b's value was produced 10 s before its batch's sample; c's with its batch
    s.ingest([with_probes(feed.batch("b"), {WAITING: 0.0}, {WAITING: 10.0}),
              with_probes(feed.batch("c"), {WAITING: 3.0})], now=0.0, now_wall=WALL)
    assert set(picks(s, 10.0)) == {"b"}  # b's value is 20 s old: fresh, ranked first
    assert set(picks(s, 10.001)) == {"c"}  # b's value now missing: sorted last


def test_store_probe_only_candidate_is_ranked_on_its_probes():
    s, feed = strategy_store("strict"), BatchFeed()
    probe_only = Batch(site="a", provider="probed", model="m", published_ms=int(WALL * 1000), age_s=0.0,
                       ready=None, ready_reason="NoMetricsSource", probes={WAITING: 0.0},
                       order=BatchOrder(int(WALL) - 100, 1))
    s.ingest([probe_only, with_probes(feed.batch("b"), {WAITING: 2.0})], now=0.0, now_wall=WALL)
    assert {(d.site, d.provider) for d in [s.decide("m", now=0.0, rng=random.Random(1))]} == {("a", "probed")}
    # without a strategy it has no load signal: used only when no candidate with one is left
    plain = GatewayStore(site="a")
    plain.set_serving(SERVING)
    plain.ingest([probe_only, with_probes(BatchFeed().batch("b"), {WAITING: 2.0})], now=0.0, now_wall=WALL)
    assert set(picks(plain, 0.0)) == {"b"}


def test_a_model_map_overrides_the_default():
    other = Strategy.of("by_kv", {}, [("performance.kv_cache_usage_perc", False)])
    table = StrategyTable(None, {"m": other})
    assert table.for_model("m") is other and table.for_model("x") is None
    assert StrategyTable(PERF, {"m": other}).for_model("x") is PERF


def test_explain_shows_the_strategys_filter_rank_and_the_503_decide_gives():
    from gridd.core.explain import explain_model

    s, feed = strategy_store(), BatchFeed()
    s.ingest([with_probes(feed.batch("a"), {WAITING: 7.0}), with_probes(feed.batch("b"), {WAITING: 1.0}),
              with_probes(feed.batch("c"), {WAITING: 2.0})], now=0.0, now_wall=WALL)
    e = explain_model(s, "m", now=0.0)
    assert e.strategy == PERF.name and e.outcome.kind == "forward"
    by_site = {c.site: c for c in e.candidates}
    assert by_site["a"].strategy.verdict == "dropped" and by_site["a"].chance == 0.0
    assert "strategy: dropped" in by_site["a"].reason
    assert (by_site["b"].strategy.position, by_site["c"].strategy.position) == (1, 2)
    # The chances are the ones decide() draws by: two choices always draws both kept, b wins.
    assert (by_site["b"].chance, by_site["c"].chance) == (1.0, 0.0) and set(picks(s, 0.0)) == {"b"}
    s.ingest([with_probes(feed.batch(x), {WAITING: 9.0}) for x in "abc"], now=1.0, now_wall=WALL)
    e = explain_model(s, "m", now=1.0)
    assert s.decide("m", now=1.0, rng=random.Random(1)) == Unavailable(5.0, cause="strategy")
    assert (e.outcome.kind, e.outcome.status, e.outcome.cause, e.outcome.retry_after_s) == (
        "unavailable", 503, "strategy", 5.0)
