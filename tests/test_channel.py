"""The signals channel on loopback: real sockets, real mutual TLS, the operator's endpoint.

Certificates come from gridd.certs library calls into tmp dirs. No MockClock here (real
sockets stay out of autojump tests); every wait is bounded by fail_after.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from functools import partial

import pytest
import trio
import trio_websocket
from prometheus_client import CollectorRegistry
from support import Issuer

from gridd.channel import (
    WS_MAX_MESSAGE_BYTES,
    Backoff,
    ChannelError,
    ChannelLimits,
    ExpectedPeer,
    open_signals_connection,
    open_signals_dialer,
    parse_signals_url,
    serve_signals,
    split_bind,
)
from gridd.config import parse_config
from gridd.core.holdings import Holdings
from gridd.core.readings import Revision
from gridd.operator.signals import SignalsEndpoint, SignalsMetrics, serving_config_for
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
        self.metrics = SignalsMetrics(self.registry)
        self.endpoint = SignalsEndpoint(config=lambda: self.cfg, holdings=self.holdings, metrics=self.metrics,
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
                await serve_signals(bind, lambda: self.server_ctx, self.endpoint.handle, limits=lambda: self.limits,
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
        async with open_signals_connection(operator.url, grid.client(OPERATOR_B),
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
        async with open_signals_connection(operator.url, grid.client(GATEWAY_A1),
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
        async with open_signals_connection(operator.url, grid.client(GATEWAY_A1),
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
        async with open_signals_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            [batches] = await conn.exchange(poll())
    assert len(encode(batches)) > 1024 * 1024
    assert len(batches.batches) == 401


# --- refusals --------------------------------------------------------------------------


async def test_client_certificate_from_another_ca_is_refused_and_counted(grid, other_ca, operator):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_signals_connection(operator.url, other_ca.client(OPERATOR_B),
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
        async with open_signals_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "c", "operator")):
            pass
    assert err.value.reason == "identity"
    assert "not of site 'c'" in str(err.value)


async def test_server_from_another_ca_is_refused_by_the_client(grid, other_ca, nursery):
    op = Operator(other_ca)
    await op.start(nursery)
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_signals_connection(op.url, grid.client(OPERATOR_B), ExpectedPeer(TD, "a", "operator")):
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
        async with open_signals_connection(operator.url, grid.client(identity),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(poll())
    assert err.value.reason == "refused" and err.value.peer_reason == reason
    assert operator.refused(reason) == 1


async def test_peer_operator_may_not_send_feedback(grid, operator):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_signals_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(FeedbackReport(reporter_epoch=1, sequence=1, skew_drops=0))
    assert err.value.peer_reason == "forbidden"
    assert operator.refused("forbidden") == 1


async def test_certificate_without_identity_is_refused_before_the_websocket(grid, operator):
    ctx = client_context(*grid.issue_without_identity(), grid.ca_file)
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_signals_connection(operator.url, ctx, ExpectedPeer(TD, "a", "operator")):
            pass
    assert err.value.reason == "connect"
    assert operator.refused("identity") == 1


async def test_other_protocol_major_version_is_refused(grid, operator):
    with trio.fail_after(5), pytest.raises(ChannelError) as err:
        async with open_signals_connection(operator.url, grid.client(OPERATOR_B),
                                           ExpectedPeer(TD, "a", "operator")) as conn:
            await conn.exchange(poll(protocol=PROTOCOL_VERSION + 1))
    assert err.value.reason == "protocol"
    assert operator.refused("protocol") == 1


async def test_a_silent_tcp_client_is_cut_at_the_handshake_bound(operator):
    operator.limits = ChannelLimits(handshake_s=0.2)
    host, port = split_bind(operator.url.removeprefix("wss://").removesuffix("/signals"))
    with trio.fail_after(5):
        async with await trio.open_tcp_stream(host, port) as stream:
            assert await stream.receive_some() == b""  # the server hung up on us
    assert operator.refused("handshake") == 1


# --- bad frames --------------------------------------------------------------------------


async def _raw_websocket(url: str, ctx: ssl.SSLContext, nursery: trio.Nursery):
    target = parse_signals_url(url)
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
        async with open_signals_connection(operator.url, grid.client(GATEWAY_A1),
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


async def test_dialer_redials_after_the_server_restarts(grid, nursery):
    op = Operator(grid)
    op.holdings.hold(held_batch("a", "llama"), trio.current_time())
    scope = await op.start(nursery)
    bind = op.url.removeprefix("wss://").removesuffix("/signals")
    with trio.fail_after(10):
        async with open_signals_dialer(op.url, grid.client(OPERATOR_B), ExpectedPeer(TD, "a", "operator"),
                                       rng=MaxRandom(), backoff=Backoff(base_s=0.05, cap_s=0.1)) as dialer:
            assert isinstance((await dialer.exchange(poll()))[-1], Batches)
            assert dialer.connections_opened == 1 and dialer.identity == OPERATOR_A

            scope.cancel()  # the server goes away
            await trio.sleep(0.05)
            with pytest.raises(ChannelError) as err:
                await dialer.exchange(poll())
            assert err.value.reason == "connect"

            # Inside the backoff window, with a deadline before the next dial: fail fast.
            with trio.move_on_after(0.01):
                with pytest.raises(ChannelError, match="backing off") as err:
                    await dialer.exchange(poll())
                assert err.value.reason == "connect"

            await op.start(nursery, bind)  # same port, new process of the server
            assert isinstance((await dialer.exchange(poll()))[-1], Batches)
            assert dialer.connections_opened == 2 and dialer.last_error is None


async def test_dialer_redials_a_connection_the_server_closed_as_idle(grid, nursery):
    op = Operator(grid)
    op.limits = ChannelLimits(idle_s=0.2)
    await op.start(nursery)
    with trio.fail_after(10):
        async with open_signals_dialer(op.url, grid.client(GATEWAY_A1), ExpectedPeer(TD, "a", "operator")) as dialer:
            await dialer.exchange(poll())
            await trio.sleep(0.5)  # more than idle_s without a message: the server closes
            replies = await dialer.exchange(poll())
    assert dialer.connections_opened == 2
    assert [type(m) for m in replies] == [ServingConfig, Batches]  # a new connection starts over


async def test_dialer_cancelled_mid_exchange_drops_the_connection(grid, nursery):
    async def never_answer(session):
        await session.receive()
        await trio.sleep_forever()

    address = await nursery.start(partial(serve_signals, "127.0.0.1:0", lambda: grid.server(OPERATOR_A),
                                          never_answer))
    url = f"wss://{address}/signals"
    with trio.fail_after(10):
        async with open_signals_dialer(url, grid.client(OPERATOR_B), ExpectedPeer(TD, "a", "operator")) as dialer:
            with trio.move_on_after(0.3) as budget:
                await dialer.exchange(poll())
            assert budget.cancelled_caught
            with trio.move_on_after(0.3):
                await dialer.exchange(poll())
    # Each exchange after a cancelled one starts on a fresh connection.
    assert dialer.connections_opened == 2


async def test_unreachable_and_unusable_urls_map_to_bounded_reasons(grid):
    ctx = grid.client(OPERATOR_B)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nothing listens there now
    with trio.fail_after(5):
        with pytest.raises(ChannelError) as err:
            async with open_signals_connection(f"wss://127.0.0.1:{port}/signals", ctx,
                                               ExpectedPeer(TD, "a", "operator")):
                pass
        assert err.value.reason == "connect"
        with pytest.raises(ChannelError) as err:
            async with open_signals_connection("ws://127.0.0.1:1/signals", ctx, ExpectedPeer(TD, "a", "operator")):
                pass
        assert err.value.reason == "protocol"


async def test_failed_handshakes_are_logged_once_per_interval_with_counts(operator, caplog):
    """The issue: every failed unauthenticated handshake logged one INFO line (log flooding).
    Now one line per REFUSAL_LOG_EVERY_S per listener, every refusal still counted."""
    caplog.set_level(logging.INFO, logger="gridd.channel")
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
