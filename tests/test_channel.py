"""The channel: real mutual TLS, the operator's endpoint, and the dialer.

Certificates come from gridd.certs library calls into tmp dirs. The first part runs on
loopback (real sockets, no MockClock; every wait bounded by fail_after); the timing rules
(handshake and idle bounds, cancellation, backoff, the gateway's poll) run on trio memory
streams under MockClock and are asserted exactly.
"""

from __future__ import annotations

import logging
import math
import random
import ssl
import time
from pathlib import Path

import pytest
import trio
import trio.testing
import trio_websocket
from prometheus_client import CollectorRegistry
from support import Issuer, just_before, settle_at

from gridd.config import load_config, parse_config
from gridd.core.holdings import Holdings
from gridd.core.readings import Revision
from gridd.gateway.service import GatewayService
from gridd.link.dial import (
    Backoff,
    ExpectedPeer,
    open_channel_connection,
    open_channel_dialer,
    parse_channel_url,
)
from gridd.link.serve import ChannelLimits, ChannelServer, serve_channel
from gridd.link.session import WS_MAX_MESSAGE_BYTES, ChannelError
from gridd.operator.channel_setup import ChannelMetrics
from gridd.operator.relay import RelayEndpoint, serving_config_for
from gridd.tls import PeerIdentity, client_context
from gridd.wire import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Batch,
    Batches,
    Cursor,
    Error,
    FeedbackAck,
    FeedbackReport,
    LocalProvider,
    Poll,
    ServingConfig,
    SiteIngress,
    SourceKey,
    decode,
    encode,
)

TD = "grid.local"
OPERATOR_A = PeerIdentity(TD, "a", "operator")
OPERATOR_B = PeerIdentity(TD, "b", "operator")
OPERATOR_C = PeerIdentity(TD, "c", "operator")
GATEWAY_A1 = PeerIdentity(TD, "a", "gateway", "g1")
GATEWAY_B1 = PeerIdentity(TD, "b", "gateway", "g1")

OPERATOR_A_CONFIG = """
role: operator
site: a
ingress: http://127.0.0.1:8000
providers:
  - name: llama
    model: m
    settings:
      endpoint: http://127.0.0.1:8088/v1
      timeout: 60
      auth: {scheme: bearer, api_key: sekret, custom_headers: {x-team: blue}}
  - name: qwen
    model: q
    settings:
      endpoint: http://127.0.0.1:8089/v1
      auth: {scheme: header, header_name: api-key, api_key: k2}
  - name: disabled
    model: o
    enabled: false
    settings: {endpoint: "http://127.0.0.1:8090/v1"}
peers:
  - {site: b, url: "wss://127.0.0.1:9/signals", ingress: "http://127.0.0.1:8001"}
"""


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Issuer:
    return Issuer.gridd(tmp_path_factory.mktemp("grid"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Issuer:
    return Issuer.gridd(tmp_path_factory.mktemp("other"))


def held_batch(site: str, provider: str, seq: int = 1, *, probes: int = 1) -> Batch:
    return Batch(site=site, provider=provider, model="m", published_ms=1_700_000_000_000 + seq, age_s=0.5,
                 revision=Revision("uid-" + provider, 3, 1_700_000_000, seq, 0), complete=False,
                 ready=True, probes={f"probe.{i}": float(i) for i in range(probes)})


class Operator:
    """Operator a's signals endpoint served on a loopback port."""

    def __init__(self, grid: Issuer) -> None:
        self.cfg, _ = parse_config(OPERATOR_A_CONFIG, env={})
        self.holdings = Holdings()
        self.registry = CollectorRegistry()
        self.metrics = ChannelMetrics(self.registry)
        self.endpoint = RelayEndpoint(config=lambda: self.cfg, holdings=self.holdings, metrics=self.metrics,
                                        wall=time.time)
        self.server_ctx = grid.server(OPERATOR_A)
        self.limits = ChannelLimits()
        self.url = ""
        self.refused_at_handshake = trio.Event()

    def count_refused(self, reason: str) -> None:
        self.metrics.count_refused(reason)
        self.refused_at_handshake.set()

    def refused(self, reason: str) -> float:
        return self.registry.get_sample_value("grid_signals_connections_refused_total", {"reason": reason})

    async def start(self, nursery: trio.Nursery, bind: str = "127.0.0.1:0") -> trio.CancelScope:
        scope = trio.CancelScope()

        async def serve(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await serve_channel(bind, lambda: self.server_ctx, self.endpoint.handle,
                                    limits=lambda: self.limits,
                                    on_refused=self.count_refused, task_status=task_status)

        address = await nursery.start(serve)
        self.url = f"wss://{address}/signals"
        return scope


@pytest.fixture
async def operator(grid, nursery) -> Operator:
    op = Operator(grid)
    op.holdings.hold(held_batch("a", "llama"), trio.current_time())
    op.holdings.hold(held_batch("b", "beta"), trio.current_time())
    await op.start(nursery)
    return op


def poll(protocol: int = PROTOCOL_VERSION) -> Poll:
    return Poll(protocol=protocol, sent_wall=time.time())


# --- round trips ---------------------------------------------------------------------


async def test_peer_operator_gets_only_the_servers_own_site(grid, operator):
    with trio.fail_after(5):
        async with open_channel_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            assert conn.identity == OPERATOR_A
            replies = await conn.exchange(poll())
    [batches] = replies
    assert isinstance(batches, Batches) and batches.protocol == PROTOCOL_VERSION
    assert [(b.site, b.provider) for b in batches.batches] == [("a", "llama")]
    # Whole batch, revision untouched, age increased by the holding time.
    sent = batches.batches[0]
    assert sent.revision == held_batch("a", "llama").revision
    assert sent.age_s >= 0.5
    assert operator.refused("forbidden") == 0


async def test_gateway_gets_serving_config_once_then_every_sites_batches(grid, operator):
    with trio.fail_after(5):
        async with open_channel_connection(operator.url, grid.client(GATEWAY_A1),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            first = await conn.exchange(poll())
            second = await conn.exchange(poll())
            operator.cfg, _ = parse_config(OPERATOR_A_CONFIG.replace("timeout: 60", "timeout: 61"), env={})
            third = await conn.exchange(poll())
            ack = await conn.exchange(FeedbackReport(reporter_epoch=7, sequence=3, skew_drops=0))
    serving, batches = first
    assert isinstance(serving, ServingConfig) and isinstance(batches, Batches)
    assert sorted((b.site, b.provider) for b in batches.batches) == [("a", "llama"), ("b", "beta")]
    assert [type(m) for m in second] == [Batches]
    assert [type(m) for m in third] == [ServingConfig, Batches]
    assert third[0].providers[0].timeout_s == 61
    assert ack == [FeedbackAck(reporter_epoch=7, sequence=3, status="not_implemented",
                               detail="this operator does not take feedback reports yet")]


def test_serving_config_carries_local_providers_and_every_ingress():
    cfg, _ = parse_config(OPERATOR_A_CONFIG, env={})
    assert serving_config_for(cfg) == ServingConfig(
        providers=(
            LocalProvider(provider="llama", model="m", endpoint_url="http://127.0.0.1:8088/v1",
                          auth_scheme="bearer", api_key="sekret", headers={"x-team": "blue"}, timeout_s=60.0),
            LocalProvider(provider="qwen", model="q", endpoint_url="http://127.0.0.1:8089/v1",
                          auth_scheme="header", api_key=None, headers={"api-key": "k2"}, timeout_s=300.0),
        ),
        ingresses=(SiteIngress("b", "http://127.0.0.1:8001"), SiteIngress("a", "http://127.0.0.1:8000")),
    )


async def test_cursors_leave_out_what_the_gateway_holds(grid, operator):
    held = held_batch("b", "beta")
    cursor = (held.site, held.provider, held.revision.publisher_epoch, held.revision.batch_sequence)
    with trio.fail_after(5):
        async with open_channel_connection(operator.url, grid.client(GATEWAY_A1),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            *_, batches = await conn.exchange(Poll(protocol=PROTOCOL_VERSION, sent_wall=time.time(),
                                                   cursors=(Cursor(*cursor),)))
    assert [(b.site, b.provider) for b in batches.batches] == [("a", "llama")]
    assert batches.unchanged == (SourceKey("b", "beta"),)


async def test_frames_above_trio_websockets_default_limit_pass(grid, operator):
    # trio-websocket's own default max_message_size is 1 MiB; the channel allows the wire's 8 MiB.
    for i in range(400):
        operator.holdings.hold(held_batch("a", f"p{i}", probes=200), trio.current_time())
    with trio.fail_after(10):
        async with open_channel_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            [batches] = await conn.exchange(poll())
    assert len(encode(batches)) > 1024 * 1024
    assert len(batches.batches) == 401


# --- refusals --------------------------------------------------------------------------


async def test_client_certificate_from_another_ca_is_refused_and_counted(grid, other_ca, operator):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(operator.url, other_ca.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(poll())
    assert err.value.reason == "tls"
    with trio.fail_after(5):
        await operator.refused_at_handshake.wait()  # the server may count after the client gave up
    assert operator.refused("tls") == 1


async def test_server_naming_another_site_is_refused_by_the_client(grid, operator):
    # The client was configured to reach site "c" at this URL; the server's verified
    # certificate names site "a".
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "c", "operator")):
            pass
    assert err.value.reason == "identity"
    assert "not of site 'c'" in str(err.value)


async def test_server_from_another_ca_is_refused_by_the_client(grid, other_ca, nursery):
    op = Operator(other_ca)
    await op.start(nursery)
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(op.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")):
            pass
    assert err.value.reason == "tls"


@pytest.mark.parametrize(
    ("identity", "reason"),
    [
        (GATEWAY_B1, "forbidden"),  # another site's gateway
        (OPERATOR_C, "forbidden"),  # an operator of a site that is not a configured peer
        (OPERATOR_A, "forbidden"),  # an operator naming the server's own site
    ],
)
async def test_unauthorized_identities_get_an_error_and_are_counted(grid, operator, identity, reason):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(operator.url, grid.client(identity),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(poll())
    assert err.value.reason == "refused" and err.value.peer_reason == reason
    assert operator.refused(reason) == 1


async def test_peer_operator_may_not_send_feedback(grid, operator):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(FeedbackReport(reporter_epoch=1, sequence=1, skew_drops=0))
    assert err.value.peer_reason == "forbidden"
    assert operator.refused("forbidden") == 1


async def test_certificate_without_identity_is_refused_before_the_websocket(grid, operator):
    ctx = client_context(*grid.issue_without_identity(), grid.ca_file)
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(operator.url, ctx, ExpectedPeer(TD, "a", "operator")):
            pass
    assert err.value.reason == "connect"
    assert operator.refused("identity") == 1


async def test_other_protocol_major_version_is_refused(grid, operator):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_channel_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(poll(protocol=PROTOCOL_VERSION + 1))
    assert err.value.reason == "protocol"
    assert operator.refused("protocol") == 1


# --- bad frames --------------------------------------------------------------------------


async def _raw_websocket(url: str, ctx: ssl.SSLContext, nursery: trio.Nursery):
    target = parse_channel_url(url)
    tcp = await trio.open_tcp_stream(target.host, target.port)
    tls = trio.SSLStream(tcp, ctx, server_hostname=None)
    await tls.do_handshake()
    ws = await trio_websocket.wrap_client_stream(nursery, tls, target.host_header, target.resource,
                                                 max_message_size=WS_MAX_MESSAGE_BYTES)
    return ws, tls


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1 not msgpack",
        encode(Error("x"))[:-1],  # truncated
        b"\x00" * (MAX_FRAME_BYTES + 1),  # one byte over the wire limit: refused by gridd.wire
        b"\x00" * (MAX_FRAME_BYTES + 64),  # beyond trio-websocket's limit: close 1009
    ],
    ids=["garbage", "truncated", "wire-oversize", "ws-oversize"],
)
async def test_bad_frame_is_counted_and_the_server_keeps_serving(grid, operator, frame):
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            ws, tls = await _raw_websocket(operator.url, grid.client(OPERATOR_B), nursery)
            await ws.send_message(frame)
            try:
                answer = decode(await ws.get_message())
            except trio_websocket.ConnectionClosed:
                answer = None  # the 1009 case: closed before an Error could be sent
            if answer is not None:
                assert answer.reason == "decode"
            with pytest.raises(trio_websocket.ConnectionClosed):
                await ws.get_message()
            await ws.aclose()
            await tls.aclose()  # trio-websocket leaves it open when the peer closed first
        assert operator.refused("decode") == 1
        # Another client is served as before.
        async with open_channel_connection(operator.url, grid.client(GATEWAY_A1),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            replies = await conn.exchange(poll())
    assert isinstance(replies[-1], Batches)


async def test_text_message_is_a_decode_error(grid, operator):
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            ws, tls = await _raw_websocket(operator.url, grid.client(OPERATOR_B), nursery)
            await ws.send_message("hello")
            assert decode(await ws.get_message()).reason == "decode"
            await ws.aclose()
            await tls.aclose()  # trio-websocket leaves it open when the peer closed first
    assert operator.refused("decode") == 1


# --- the persistent dialer ------------------------------------------------------------------


class MaxRandom(random.Random):
    """A random source whose uniform() always draws the top of the range."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_backoff_is_full_jitter_over_a_doubling_capped_ceiling():
    backoff, top = Backoff(base_s=0.2, cap_s=10.0), MaxRandom()
    assert [backoff.delay(n, top) for n in range(1, 9)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]
    assert backoff.delay(10_000, top) == 10.0
    draws = [backoff.delay(3, random.Random(n)) for n in range(200)]
    assert all(0.0 <= d <= 0.8 for d in draws) and max(draws) > 0.6 and min(draws) < 0.2


async def test_unreachable_and_unusable_urls_map_to_bounded_reasons(grid):
    ctx = grid.client(OPERATOR_B)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nothing listens there now
    with trio.fail_after(5):
        with pytest.raises(ChannelError) as err:
            async with open_channel_connection(f"wss://127.0.0.1:{port}/signals", ctx,
                                               ExpectedPeer(TD, "a", "operator")):
                pass
        assert err.value.reason == "connect"
        with pytest.raises(ChannelError) as err:
            async with open_channel_connection("ws://127.0.0.1:1/signals", ctx,
                                               ExpectedPeer(TD, "a", "operator")):
                pass
        assert err.value.reason == "protocol"


async def test_failed_handshakes_are_logged_once_per_interval_with_counts(operator, caplog):
    """The issue: every failed unauthenticated handshake logged one INFO line (log flooding).
    Now one line per REFUSAL_LOG_EVERY_S per listener, every refusal still counted."""
    caplog.set_level(logging.INFO, logger="gridd.link.serve")
    host, port = operator.url.removeprefix("wss://").removesuffix("/signals").rsplit(":", 1)
    for _ in range(5):
        operator.refused_at_handshake = trio.Event()
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(b"GET / HTTP/1.1\r\n\r\n")  # not TLS: the handshake fails
        with trio.fail_after(5):
            await operator.refused_at_handshake.wait()
        await stream.aclose()
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("signals connections refused (1 ")
    assert operator.refused("tls") + operator.refused("handshake") == 5


# --- on trio memory streams, in MockClock time ------------------------------------------------
#
# The dialer's stream factory hands it one end of a trio memory stream pair; a ChannelServer
# serves the other end. TLS, identities, the WebSocket and the operator's endpoint are all
# real; only the transport is in memory, so every timing rule is asserted exactly.

OPERATOR_URL = "wss://op-a:1/signals"


class MemoryNet:
    """The channel over memory streams: each dial gets a fresh pair whose far end the server
    serves. ``reachable = False``: dials fail as a refused TCP connect would (OSError)."""

    def __init__(self, nursery: trio.Nursery, server: ChannelServer) -> None:
        self.nursery = nursery
        self.server = server
        self.reachable = True
        self.dials: list[float] = []
        self._serving: list[trio.CancelScope] = []

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        self.dials.append(trio.current_time())
        if not self.reachable:
            raise OSError(f"connection to {host}:{port} refused")
        client, server = trio.testing.memory_stream_pair()
        scope = trio.CancelScope()
        self._serving.append(scope)
        self.nursery.start_soon(self._serve, server, scope)
        return client

    async def _serve(self, stream: trio.abc.Stream, scope: trio.CancelScope) -> None:
        with scope:
            await self.server.serve_stream(stream, "memory")

    def stop(self) -> None:
        """The server process goes away: every connection drops, new dials are refused."""
        self.reachable = False
        for scope in self._serving:
            scope.cancel()
        self._serving.clear()


def memory_operator(grid: Issuer, nursery: trio.Nursery, limits: ChannelLimits | None = None,
                    handler=None) -> tuple[Operator, MemoryNet]:
    op = Operator(grid)
    limits = limits or ChannelLimits()
    op.holdings.hold(held_batch("a", "llama"), trio.current_time())
    server = ChannelServer(lambda: op.server_ctx, handler or op.endpoint.handle, limits=lambda: limits,
                           on_refused=op.count_refused)
    return op, MemoryNet(nursery, server)


async def test_memory_a_silent_client_is_cut_at_exactly_the_handshake_bound(grid, nursery, autojump_clock):
    op, net = memory_operator(grid, nursery, ChannelLimits(handshake_s=0.2))
    t0 = trio.current_time()
    stream = await net.open_stream("op-a", 1)
    assert await stream.receive_some() == b""  # the server hung up on us...
    assert trio.current_time() == t0 + 0.2  # ...at exactly handshake_s
    assert op.refused("handshake") == 1


async def test_memory_a_connection_idle_for_idle_s_is_closed_and_the_dialer_redials(grid, nursery,
                                                                                   autojump_clock):
    op, net = memory_operator(grid, nursery, ChannelLimits(idle_s=3.0))
    async with open_channel_dialer(OPERATOR_URL, grid.client(GATEWAY_A1), ExpectedPeer(TD, "a", "operator"),
                                   open_stream=net.open_stream) as dialer:
        t0 = trio.current_time()
        assert [type(m) for m in await dialer.exchange(poll())] == [ServingConfig, Batches]
        await settle_at(t0 + 2.0)
        await dialer.exchange(poll())  # a message re-arms the idle bound: now t0 + 5.0
        await settle_at(just_before(t0 + 5.0))
        assert op.endpoint.open_connections["gateway"] == 1
        await settle_at(t0 + 5.0)
        assert op.endpoint.open_connections["gateway"] == 0  # closed at exactly idle_s
        replies = await dialer.exchange(poll())
    assert dialer.connections_opened == 2 and net.dials == [t0, t0 + 5.0]
    assert [type(m) for m in replies] == [ServingConfig, Batches]  # a new connection starts over


async def test_memory_dialer_cancelled_mid_exchange_drops_the_connection(grid, nursery, autojump_clock):
    async def never_answer(session):
        await session.receive()
        await trio.sleep_forever()

    _, net = memory_operator(grid, nursery, handler=never_answer)
    async with open_channel_dialer(OPERATOR_URL, grid.client(OPERATOR_B), ExpectedPeer(TD, "a", "operator"),
                                   open_stream=net.open_stream) as dialer:
        t0 = trio.current_time()
        with trio.move_on_after(0.3) as budget:
            await dialer.exchange(poll())
        assert budget.cancelled_caught and trio.current_time() == t0 + 0.3
        with trio.move_on_after(0.3):
            await dialer.exchange(poll())
    # Each exchange after a cancelled one starts on a fresh connection, at once.
    assert dialer.connections_opened == 2 and net.dials == [t0, t0 + 0.3]


async def test_memory_dialer_waits_out_its_backoff_exactly_and_fails_fast_inside_it(grid, nursery,
                                                                                   autojump_clock):
    _, net = memory_operator(grid, nursery)
    net.reachable = False
    async with open_channel_dialer(OPERATOR_URL, grid.client(OPERATOR_B), ExpectedPeer(TD, "a", "operator"),
                                   rng=MaxRandom(), backoff=Backoff(base_s=0.2, cap_s=10.0),
                                   open_stream=net.open_stream) as dialer:
        t0 = trio.current_time()
        for _ in range(2):
            with pytest.raises(ChannelError) as err:
                await dialer.exchange(poll())
            assert err.value.reason == "connect"
        # The first failure's backoff (0.2 s at most; MaxRandom draws the top) was waited out.
        assert net.dials == [t0, t0 + 0.2]
        # Inside the second backoff (0.4 s, to t0 + 0.6) with a deadline before it: fail fast,
        # no dial, no time spent.
        with trio.move_on_after(0.1):
            with pytest.raises(ChannelError, match="backing off") as err:
                await dialer.exchange(poll())
        assert err.value.reason == "connect" and trio.current_time() == t0 + 0.2
        net.reachable = True
        assert isinstance((await dialer.exchange(poll()))[-1], Batches)
    assert net.dials == [t0, t0 + 0.2, t0 + 0.2 + 0.4]  # the second backoff, from the second dial
    assert dialer.connections_opened == 1 and dialer.last_error is None


async def test_memory_dialer_redials_at_once_after_the_server_restarts(grid, nursery, autojump_clock):
    _, net = memory_operator(grid, nursery)
    async with open_channel_dialer(OPERATOR_URL, grid.client(OPERATOR_B), ExpectedPeer(TD, "a", "operator"),
                                   rng=MaxRandom(), backoff=Backoff(base_s=0.2, cap_s=10.0),
                                   open_stream=net.open_stream) as dialer:
        t0 = trio.current_time()
        assert isinstance((await dialer.exchange(poll()))[-1], Batches)
        assert dialer.connections_opened == 1 and dialer.identity == OPERATOR_A
        await settle_at(t0 + 1.0)
        net.stop()  # the server goes away: the kept connection is dead, re-dials refused
        with pytest.raises(ChannelError) as err:
            await dialer.exchange(poll())
        assert err.value.reason == "connect"
        net.reachable = True  # a new process of the server
        await settle_at(t0 + 2.0)
        assert isinstance((await dialer.exchange(poll()))[-1], Batches)
    # The dead kept connection was re-dialed at once (t0 + 1); after that failure the next
    # dial waited for no longer than its backoff, which had passed by t0 + 2.
    assert net.dials == [t0, t0 + 1.0, t0 + 2.0]
    assert dialer.connections_opened == 2 and dialer.last_error is None


GATEWAY_CONFIG = """
role: gateway
site: {site}
replica: g1
tls: {{ca: "{ca}", cert: "{cert}", key: "{key}"}}
operator: {{url: "{url}"}}
"""


async def start_gateway(grid: Issuer, tmp_path: Path, identity: PeerIdentity, net: MemoryNet,
                        nursery: trio.Nursery, clock) -> GatewayService:
    """A gateway whose operator link is the real dialer, over the memory net."""
    cert, key = grid.issue(identity)
    path = tmp_path / "gateway.yaml"
    path.write_text(GATEWAY_CONFIG.format(site=identity.site, ca=grid.ca_file, cert=cert, key=key,
                                          url=OPERATOR_URL))

    def open_link():
        return open_channel_dialer(OPERATOR_URL, grid.client(identity), ExpectedPeer(TD, "a", "operator"),
                                   rng=MaxRandom(), backoff=Backoff(base_s=0.2, cap_s=10.0),
                                   open_stream=net.open_stream)

    gateway = GatewayService(load_config(path, env={}), CollectorRegistry(), wall=time.time,
                             rng=random.Random(1), open_operator_link=open_link)
    clock.autojump_threshold = math.inf  # start-up checks the TLS files in worker threads
    await nursery.start(gateway.run)
    clock.autojump_threshold = 0
    return gateway


async def test_gateway_polls_through_the_real_dialer_every_interval(grid, nursery, autojump_clock, tmp_path):
    _, net = memory_operator(grid, nursery)
    gateway = await start_gateway(grid, tmp_path, GATEWAY_A1, net, nursery, autojump_clock)
    t0 = trio.current_time()
    await settle_at(t0 + 2.0)
    assert gateway.poll_results == {"ok": 3}  # +0, +1, +2 on one connection
    assert net.dials == [t0] and gateway.operator_state == "up" and gateway.last_poll_error is None
    assert gateway.store.candidates[("a", "llama")].batch is not None


async def test_gateway_poll_refused_by_the_operator_is_a_refused_failure(grid, nursery, autojump_clock,
                                                                         tmp_path, caplog):
    """The refused branch, reached through the real dialer's contract: the operator answers
    Error (a gateway of site b may poll only its own site's operator), the dialer raises
    ChannelError("refused"), the shared poller counts and logs it."""
    caplog.set_level(logging.INFO, logger="gridd.gateway")
    op, net = memory_operator(grid, nursery)
    gateway = await start_gateway(grid, tmp_path, GATEWAY_B1, net, nursery, autojump_clock)
    t0 = trio.current_time()
    await settle_at(t0 + 2.0)
    assert gateway.poll_results == {"ok": 0, "refused": 3} and op.refused("forbidden") == 3
    assert gateway.operator_state == "down"
    detail = (f"{OPERATOR_A.uri} at {OPERATOR_URL}: refused (forbidden): "
              "gateway of site 'b' may only poll its own site's operator")
    assert gateway.last_poll_error == f"refused: {detail}"
    # Refused polls re-dial after the backoff (0.2 s, then 0.4 s: within each interval).
    assert net.dials == [t0, t0 + 1.0, t0 + 2.0]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("operator ")]
    assert lines == [f"operator {OPERATOR_URL}: link down, poll failed (refused): {detail}"]
