"""The whole grid on trio's MockClock: two operators and a gateway as their real trio tasks,
simulators as in-process ASGI apps, and the signals channel replaced by an in-memory link
that still runs every frame through the wire codec and the operator's real endpoint.

Timing rules asserted at the defaults (1 s scrape, 1 s gateway poll, 5 s peer poll):

* local exclusion: the gateway reads the relayed ready-endpoint count, so a site whose
  count drops to zero leaves selection at the first gateway poll after the first zero
  scrape. The spec's "about 3 s" bounds it: here zero is set at +10.25, the scrape at +11
  reads it, the gateway poll at +11.5 excludes it (1.25 s; at worst scrape interval + poll
  interval = 2 s, under the spec's ~3 s, which also covers the EPP's own refresh).
* local rejoin: one non-zero scrape and one poll ("about 2 s"): cleared at +20.25, scrape
  at +21, poll at +21.5.
* remote site: its reading reaches the gateway through operator a's peer poll every 5 s
  (at +0, +5, +10, ...): zero at +10.25, b's scrape at +11, a's peer poll at +15, the gateway
  poll at +15.5 (5 s later than local, waiting on the peer poll as the spec says).
"""

from __future__ import annotations

import math

import httpx
import pytest
import trio
import trio.testing
from support import WALL0, Grid, just_before, settle_at, write_certs

from gridd import wire
from gridd.config import load_config


@pytest.fixture
async def grid(tmp_path, autojump_clock):
    # Each test requests autojump_clock too: pytest-trio takes the clock from the test.
    async with Grid(tmp_path).running(autojump_clock) as grid:
        yield grid


async def test_both_sites_reach_the_gateway_and_route(grid, autojump_clock):
    await trio.sleep_until(grid.origin + 5.6)  # a's first peer poll at +0 found b not yet scraped; +5 did
    assert sorted(grid.ordered_sites()) == ["a", "b"]
    picked = {grid.gateway.router.decide("m").site for _ in range(200)}
    assert picked <= {"a", "b"} and "a" in picked


async def test_local_exclusion_and_rejoin_times(grid, autojump_clock):
    o = grid.origin
    await trio.sleep_until(o + 10.25)
    grid.sims["a"].set_knobs(zero_ready=True)
    await settle_at(just_before(o + 11.5))
    assert "a" in grid.ordered_sites()
    await settle_at(o + 11.5)
    assert grid.excluded_sites() == ["a"] and grid.ordered_sites() == ["b"]
    assert all(grid.gateway.router.decide("m").site == "b" for _ in range(100))
    await trio.sleep_until(o + 20.25)
    grid.sims["a"].set_knobs(zero_ready=False)
    await settle_at(just_before(o + 21.5))
    assert grid.excluded_sites() == ["a"]
    await settle_at(o + 21.5)
    assert grid.excluded_sites() == [] and "a" in grid.ordered_sites()


async def test_remote_exclusion_waits_on_the_peer_poll(grid, autojump_clock):
    o = grid.origin
    await trio.sleep_until(o + 10.25)
    grid.sims["b"].set_knobs(zero_ready=True)
    await settle_at(just_before(o + 15.5))
    assert "b" in grid.ordered_sites()  # b's scrape at +11 read zero; a polls b at +15
    await settle_at(o + 15.5)
    assert grid.excluded_sites() == ["b"]
    await trio.sleep_until(o + 20.25)
    grid.sims["b"].set_knobs(zero_ready=False)
    await settle_at(just_before(o + 25.5))
    assert grid.excluded_sites() == ["b"]
    await settle_at(o + 25.5)
    assert grid.excluded_sites() == [] and "b" in grid.ordered_sites()


async def test_gateway_polls_carry_cursors_so_only_changed_batches_are_sent(grid, autojump_clock):
    # The gateway polls at +0.5, +1.5, ...; a's own batch changes every scrape (every
    # second), b's only when operator a polls b (+5, +10, +15). With cursors b's batch
    # travels once per peer poll and is named unchanged on the other polls.
    o = grid.origin
    await trio.sleep_until(o + 16.0)
    polls = [(round(t - o, 2), request, replies[-1]) for t, request, replies in grid.gateway_exchanges
             if isinstance(request, wire.Poll) and t > o + 6]
    assert [t for t, _, _ in polls] == [6.5 + i for i in range(10)]
    held = grid.gateway.store.fences
    for t, request, answer in polls:
        assert {(c.site, c.provider) for c in request.cursors} == {("a", "pool-a"), ("b", "pool-b")}
        assert [(b.site, b.provider) for b in answer.batches if b.site == "a"] == [("a", "pool-a")]
        b_sent = [b for b in answer.batches if b.site == "b"]
        if t in (10.5, 15.5):
            assert len(b_sent) == 1 and answer.unchanged == ()
        else:
            assert b_sent == [] and answer.unchanged == (wire.SourceKey("b", "pool-b"),)
    # The unchanged batch is held as a repeat: age unchanged, its fence that of +15's batch,
    # and nothing counted as dropped.
    cand = grid.gateway.store.candidates[("b", "pool-b")]
    assert held.cursors() and cand.received_at == o + 15.5
    assert wire.ordering(cand.batch) == next((c.publisher_epoch, c.batch_sequence) for c in held.cursors()
                                             if c.site == "b")
    assert sum(held.drops().values()) == 0
    assert sorted(grid.ordered_sites()) == ["a", "b"]


async def test_every_candidate_excluded_is_503_not_404(grid, autojump_clock):
    from gridd.core.decisions import Unavailable, UnknownModel

    o = grid.origin
    await trio.sleep_until(o + 6.0)
    grid.sims["a"].set_knobs(zero_ready=True)
    grid.sims["b"].set_knobs(zero_ready=True)
    await trio.sleep_until(o + 16.0)
    decision = grid.gateway.router.decide("m")
    assert isinstance(decision, Unavailable) and decision.retry_after_s == 2.0
    assert isinstance(grid.gateway.router.decide("unknown-model"), UnknownModel)


async def test_dead_peer_sorts_last_within_the_ttl_and_is_then_silent(grid, autojump_clock):
    from gridd.core.decisions import Forward

    o = grid.origin
    await trio.sleep_until(o + 7.0)
    assert sorted(grid.ordered_sites()) == ["a", "b"]
    grid.up["b"]["up"] = False  # operator b stops answering; its last batch came at a's +5 poll
    # b's sample was ~0.5-1 s old when a polled it at +5; the gateway holds it as a repeat
    # (age unchanged), so it crosses the 20 s TTL a little before +25: stale, sorted last.
    await trio.sleep_until(o + 25.6)
    snap = grid.gateway.store.snapshots["m"]
    assert [(v.site, v.stale) for v in snap.ordered] == [("a", False), ("b", True)]
    # operator a relays b's ageing reading until 2 x TTL (checked every second), then
    # forgets it; the gateway holds b as silent from 2 x TTL: excluded (a model served only
    # by b would answer 503, not 404) until routing.candidate_retention_s (600 s).
    await trio.sleep_until(o + 44.0)
    snap = grid.gateway.store.snapshots["m"]
    assert [(v.site, v.stale) for v in snap.ordered] == [("a", False), ("b", True)]
    await trio.sleep_until(o + 47.0)
    assert grid.ordered_sites() == ["a"] and grid.excluded_sites() == ["b"]
    decisions = [grid.gateway.router.decide("m") for _ in range(20)]
    assert all(isinstance(d, Forward) and d.site == "a" for d in decisions)
    # /metrics already stopped showing b at the TTL
    reg = grid.operators["a"].registry
    assert reg.get_sample_value("grid_provider_ready", {"grid_site": "b", "grid_provider": "pool-b"}) is None
    assert reg.get_sample_value("grid_provider_ready", {"grid_site": "a", "grid_provider": "pool-a"}) == 1.0
    peer_b = next(p for p in grid.operators["a"].status()["peers"] if p["site"] == "b")
    assert peer_b["state"] == "down" and peer_b["last_error"] == "timeout"


async def saturate(sim, n: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """n long streamed requests held in the simulator until cancelled (2 x 8 slots: 16 run,
    the rest wait)."""
    async def one(client):
        await client.post("http://sim/v1/completions", json={
            "model": "m", "prompt": "x", "max_tokens": 10_000, "stream": True})

    async with (httpx.AsyncClient(transport=httpx.ASGITransport(app=sim)) as client,
                trio.open_nursery() as nursery):
        for _ in range(n):
            nursery.start_soon(one, client)
        task_status.started()


async def test_shedding_flips_after_full_after_and_back_after_room_after(grid, autojump_clock):
    from gridd.core.decisions import Forward, Shed

    o = grid.origin
    await trio.sleep_until(o + 5.25)
    async with trio.open_nursery() as load:
        await load.start(saturate, grid.sims["a"], 40)
        await load.start(saturate, grid.sims["b"], 40)
        # a's scrape at +6 shows 16 running + 24 waiting, at the gateway from its +6.5 poll;
        # b's scrape at +6 reaches a's peer poll at +10 and the gateway at +10.5: from then on
        # every healthy site is full (queues deeper than the batches). Shedding starts full_after_ms
        # (2 s) later, at +12.5.
        await settle_at(o + 10.5)
        snap = grid.gateway.store.snapshots["m"]
        assert snap.all_full and {v.site for v in snap.ordered} == {"a", "b"}
        await settle_at(just_before(o + 12.5))
        assert isinstance(grid.gateway.router.decide("m"), Forward)
        await settle_at(o + 12.5)
        # every site still full: Retry-After is a whole room_after_ms
        assert grid.gateway.router.decide("m") == Shed(5.0)
        await trio.sleep_until(o + 15.25)
        load.cancel_scope.cancel()  # the clients go away; the simulators drain at once
    # a's idle reading (scrape at +16) lands at +16.5: from then on a is not full, though b's
    # saturated reading (taken at +15) stays b's latest until a's peer poll at +20 (at the
    # gateway at +20.5). Shedding ends once some site has not been full for room_after_ms
    # (5 s), counted from +16.5 whatever b reads: at +21.5.
    await settle_at(just_before(o + 20.5))
    snap = grid.gateway.store.snapshots["m"]
    assert {v.site: v.full for v in snap.ordered} == {"a": False, "b": True}
    assert isinstance(grid.gateway.router.decide("m"), Shed)
    await settle_at(just_before(o + 21.5))
    assert isinstance(grid.gateway.router.decide("m"), Shed)
    await settle_at(o + 21.5)
    assert isinstance(grid.gateway.router.decide("m"), Forward)


async def test_gateway_certificate_rotation_restarts_only_the_link_and_keeps_the_store(grid, autojump_clock,
                                                                                       tmp_path):
    o = grid.origin
    await trio.sleep_until(o + 6.0)
    store, learner = grid.gateway.store, grid.gateway.store.candidates[("a", "pool-a")].learner
    inner, restarts = grid.gateway.ingress.inner, grid.gateway.poller_restarts
    write_certs(tmp_path / "certs", WALL0 + 6.0)  # a new CA and new certificates: a rotation
    autojump_clock.autojump_threshold = math.inf  # stage() checks files in a worker thread
    staged = await grid.gateway.stage(load_config(tmp_path / "gw-a.yaml", env={}))
    grid.gateway.commit(staged)
    autojump_clock.autojump_threshold = 0
    assert grid.gateway.poller_restarts == restarts + 1 and grid.gateway.ingress.inner is not inner
    assert grid.gateway.store is store and store.candidates[("a", "pool-a")].learner is learner
    # an unchanged reload restarts nothing
    autojump_clock.autojump_threshold = math.inf
    grid.gateway.commit(await grid.gateway.stage(load_config(tmp_path / "gw-a.yaml", env={})))
    autojump_clock.autojump_threshold = 0
    assert grid.gateway.poller_restarts == restarts + 1


async def test_a_batch_the_wire_cannot_carry_does_not_blind_the_gateway(grid, autojump_clock):
    from gridd.core.readings import Revision

    o = grid.origin
    await trio.sleep_until(o + 6.0)
    bad = wire.Batch(site="a", provider="broken", model="m", published_ms=1, age_s=0.0,
                     revision=Revision("u", 1, 2**70, 1, 0))  # an integer no 64-bit wire carries
    grid.operators["a"].holdings.hold(bad, trio.current_time())
    await trio.sleep_until(o + 8.0)
    assert sorted(grid.ordered_sites()) == ["a", "b"]  # the good batches still arrive
    assert grid.gateway.operator_state == "up"
    reg = grid.operators["a"].registry
    assert reg.get_sample_value("grid_signals_unsendable_batches_total") >= 1


async def test_the_gateways_operator_link_logs_down_and_up_once(grid, autojump_clock, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="gridd.gateway")
    o = grid.origin
    await trio.sleep_until(o + 10.0)
    grid.up["a"]["up"] = False  # polls at +10.5 ... +16.5 hang until their 2 s budget
    await trio.sleep_until(o + 17.0)
    grid.up["a"]["up"] = True
    await trio.sleep_until(o + 30.0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("operator wss://op-a:1")]
    assert lines == [
        "operator wss://op-a:1/signals: link up, polling",
        "operator wss://op-a:1/signals: link down, poll failed (timeout): no answer within 2 s",
        "operator wss://op-a:1/signals: link up, polling",
    ]
