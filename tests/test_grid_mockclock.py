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
import random
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from gridd import wire
from gridd.certs import certificate_pem, create_ca, issue_certificate, private_key_pem
from gridd.config import load_config
from gridd.gateway.service import GatewayService
from gridd.link.session import ChannelError
from gridd.operator.service import OperatorService
from gridd.sim.app import SimApp
from gridd.sim.model import knobs_from
from gridd.tls import PeerIdentity

TD = "grid.local"
WALL0 = 1_800_000_000.0


def wall() -> float:
    return WALL0 + trio.current_time()


def write_certs(directory, now: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = create_ca(TD, now=now, days=30)
    (directory / "ca.pem").write_bytes(certificate_pem(ca_cert))
    for site, role, replica in (("a", "operator", None), ("b", "operator", None), ("a", "gateway", "g1")):
        identity = PeerIdentity(TD, site, role, replica)
        cert, key = issue_certificate(ca_cert, ca_key, identity,
                                      now=now, days=30)
        name = f"{site}-{role}" + (f"-{replica}" if replica else "")
        (directory / f"{name}.pem").write_bytes(certificate_pem(cert))
        (directory / f"{name}-key.pem").write_bytes(private_key_pem(key))


def operator_config(site: str, other: str) -> str:
    return f"""
role: operator
site: {site}
tls: {{ca: certs/ca.pem, cert: certs/{site}-operator.pem, key: certs/{site}-operator-key.pem}}
state_dir: state-{site}
ingress: http://gw-{site}
providers:
  - name: pool-{site}
    model: m
    settings: {{endpoint: "http://sim-{site}/v1"}}
    metrics: {{url: "http://sim-{site}/metrics", timeout_s: 2}}
peers:
  - {{site: {other}, url: "wss://op-{other}:1/signals", ingress: "http://gw-{other}"}}
"""


GATEWAY = """
role: gateway
site: a
replica: g1
tls: {ca: certs/ca.pem, cert: certs/a-gateway-g1.pem, key: certs/a-gateway-g1-key.pem}
operator: {url: "wss://op-a:1/signals"}
availability: {shedding: {enabled: true, full_after_ms: 2000, room_after_ms: 5000}}
"""


class MemorySession:
    """The server side of an in-memory signals connection (what RelayEndpoint reads)."""

    def __init__(self, identity: PeerIdentity, inbox, outbox, where: str) -> None:
        self.identity, self._in, self._out, self.where = identity, inbox, outbox, where

    async def receive(self) -> wire.Message:
        try:
            return wire.decode(await self._in.receive())
        except trio.EndOfChannel:
            raise ChannelError("closed", reason="connect") from None

    async def send(self, msg: wire.Message) -> None:
        await self.send_frame(wire.encode(msg))

    async def send_frame(self, frame: bytes) -> None:
        try:
            await self._out.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ChannelError("closed", reason="connect") from None


class MemoryLink:
    def __init__(self, outbox, inbox, up: dict, server: PeerIdentity, exchanges: list | None = None) -> None:
        self._out, self._in, self._up = outbox, inbox, up
        self.exchanges = exchanges  # (time, request, replies) of every exchange, when given
        self.identity = server  # the verified identity of the operator answering
        self.connections_opened = 1

    async def exchange(self, msg: wire.Message) -> list[wire.Message]:
        if not self._up["up"]:
            await trio.sleep_forever()  # an unreachable operator: the caller's budget ends it
        await self._out.send(wire.encode(msg))
        replies = []
        while True:
            reply = wire.decode(await self._in.receive())
            replies.append(reply)
            if isinstance(reply, wire.Batches | wire.FeedbackAck | wire.Error):
                if self.exchanges is not None:
                    self.exchanges.append((trio.current_time(), msg, replies))
                return replies


def memory_link_factory(endpoint, identity: PeerIdentity, up: dict, server: PeerIdentity,
                        exchanges: list | None = None):
    @asynccontextmanager
    async def open_link(*_args):
        c2s_send, c2s_recv = trio.open_memory_channel(math.inf)
        s2c_send, s2c_recv = trio.open_memory_channel(math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(endpoint.handle, MemorySession(identity, c2s_recv, s2c_send, identity.uri))
            yield MemoryLink(c2s_send, s2c_recv, up, server, exchanges)
            nursery.cancel_scope.cancel()

    return open_link


class Grid:
    def __init__(self, tmp_path) -> None:
        write_certs(tmp_path / "certs", WALL0)
        self.sims = {site: SimApp(knobs_from({"endpoints": 2, "model": "m"})) for site in ("a", "b")}
        self.up = {"a": {"up": True}, "b": {"up": True}}
        self.operators: dict[str, OperatorService] = {}
        for site, other in (("a", "b"), ("b", "a")):
            (tmp_path / f"op-{site}.yaml").write_text(operator_config(site, other))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.sims[site]))
            self.operators[site] = OperatorService(
                load_config(tmp_path / f"op-{site}.yaml", env={}), CollectorRegistry(), wall=wall,
                client=client,
                rng=random.Random(1), open_peer_link=self._peer_link(site, other))
        (tmp_path / "gw-a.yaml").write_text(GATEWAY)
        self.gateway_exchanges: list = []
        self.gateway = GatewayService(
            load_config(tmp_path / "gw-a.yaml", env={}), CollectorRegistry(), wall=wall, rng=random.Random(2),
            open_operator_link=memory_link_factory(self.operators["a"].endpoint,
                                                   PeerIdentity(TD, "a", "gateway", "g1"), self.up["a"],
                                                   PeerIdentity(TD, "a", "operator"), self.gateway_exchanges))

    def _peer_link(self, site: str, other: str):
        def open_link(peer):
            return memory_link_factory(self.operators[other].endpoint, PeerIdentity(TD, site, "operator"),
                                       self.up[other], PeerIdentity(TD, other, "operator"))()
        return open_link

    def ordered_sites(self) -> list[str]:
        snap = self.gateway.store.snapshots.get("m")
        return [] if snap is None else [v.site for v in snap.ordered]

    def excluded_sites(self) -> list[str]:
        snap = self.gateway.store.snapshots.get("m")
        return [] if snap is None else [v.site for v in snap.excluded]

    async def start(self, nursery, clock) -> float:
        # Start-up runs blocking work in threads (TLS checks, the durable epoch write); an
        # autojumping clock would leap to the next timer meanwhile. Hold time still while
        # starting, place the gateway half a second after the operators, then let it run.
        clock.autojump_threshold = math.inf
        origin = trio.current_time()
        await nursery.start(self.operators["a"].run)  # scrape passes at +0, +1, ...
        await nursery.start(self.operators["b"].run)  # a polls b at +0, +5, ...
        clock.jump(0.5)
        await nursery.start(self.gateway.run)  # gateway polls at +0.5, +1.5, ...
        clock.autojump_threshold = 0
        return origin


def just_before(t: float) -> float:
    """The last instant MockClock can stand at before ``t``: "not yet" asserted exactly."""
    return math.nextafter(t, -math.inf)


async def settle_at(t: float) -> None:
    """Stand at ``t`` once every task due by then has run (the grid is in memory, so an
    exchange takes no virtual time)."""
    await trio.sleep_until(t)
    await trio.testing.wait_all_tasks_blocked()


@pytest.fixture
async def grid(tmp_path, autojump_clock):
    # Each test requests autojump_clock too: pytest-trio takes the clock from the test.
    grid = Grid(tmp_path)
    async with trio.open_nursery() as nursery:
        grid.origin = await grid.start(nursery, autojump_clock)
        yield grid
        nursery.cancel_scope.cancel()


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
