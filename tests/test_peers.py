"""Peer pollers on trio's MockClock: schedule, budget, isolation, admission, reload, expiry.

The pollers get a fake link (no sockets) through the supervisor's injected ``open_link``,
so every timing rule is asserted exactly in virtual time (STYLE 12, 13). The last tests
wire the same supervisor through OperatorService with real TLS files (real clock, no
timing assertions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import support
import trio
import trio.testing
from prometheus_client import CollectorRegistry
from support import write_certs

from gridd.config import load_config
from gridd.config_schema import LimitsConfig, PeerConfig, TimingConfig
from gridd.core.admission import AdmissionFences
from gridd.core.holdings import Holdings
from gridd.errors import ConfigError
from gridd.link.periodic import next_start, run_periodic
from gridd.link.session import ChannelError
from gridd.link.supervisor import TaskSupervisor
from gridd.operator.peers import PeerSupervisor
from gridd.operator.service import OperatorService
from gridd.tls import PeerIdentity, TLSMaterialError
from gridd.wire import PROTOCOL_VERSION, Batches, Message, Poll

TD = "grid.local"
WALL0 = 1_700_000_000.0  # the receiver's wall clock at trio time 0

PEER_B = PeerConfig(site="b", url="wss://127.0.0.1:9001/signals")
PEER_C = PeerConfig(site="c", url="wss://127.0.0.1:9002/signals")


# A batch without a reading from operator b, its epoch 1000 s before WALL0.
batch = partial(support.batch, epoch=1_699_999_000, complete=False)


class FakeLink:
    """A peer that answers each poll from a script; None = never answers (hangs)."""

    def __init__(self, site: str, answer: Callable[[int], object]) -> None:
        self.identity = PeerIdentity(TD, site, "operator")
        self.connections_opened = 1
        self.answer = answer
        self.started_at: list[float] = []

    async def exchange(self, msg: Poll) -> list[Message]:
        assert msg.protocol == PROTOCOL_VERSION
        self.started_at.append(trio.current_time())
        result = self.answer(len(self.started_at) - 1)
        if isinstance(result, Exception):
            raise result
        if result is None:
            await trio.sleep_forever()
        delay, batches = result if isinstance(result, tuple) else (0.0, result)
        await trio.sleep(delay)
        return [Batches(protocol=PROTOCOL_VERSION, sent_wall=0.0, batches=tuple(batches))]


class Harness:
    def __init__(self, timings: TimingConfig | None = None, *, own_site: str = "a") -> None:
        self.timings = timings or TimingConfig()
        self.holdings = Holdings()
        self.fences = AdmissionFences(future_epoch_bound_s=self.timings.future_epoch_bound_s)
        self.links: dict[tuple[str, str], list[FakeLink]] = {}
        self.scripts: dict[str, Callable[[int], object]] = {}
        self.supervisor = PeerSupervisor(
            own_site=own_site, fences=self.fences, holdings=self.holdings, timings=lambda: self.timings,
            wall=lambda: WALL0 + trio.current_time(), open_link=self.open_link)

    @asynccontextmanager
    async def open_link(self, peer: PeerConfig):
        link = FakeLink(peer.site, self.scripts.get(peer.site, lambda n: []))
        self.links.setdefault((peer.site, peer.url), []).append(link)
        yield link

    def link(self, peer: PeerConfig, index: int = -1) -> FakeLink:
        return self.links[(peer.site, peer.url)][index]

    def drops(self, reason: str) -> int:
        return self.fences.drops()[reason]


async def start(nursery: trio.Nursery, harness: Harness, peers: list[PeerConfig]) -> None:
    await nursery.start(harness.supervisor.run, peers)


# --- schedule and budget -----------------------------------------------------------------


async def test_polls_every_interval_start_to_start(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: (1.25, [])  # each exchange takes 1.25 s: no drift from it
    await start(nursery, h, [PEER_B])
    await trio.sleep(20.5)
    assert h.link(PEER_B).started_at == [0.0, 5.0, 10.0, 15.0, 20.0]


async def test_budget_bounds_a_hanging_peer_and_the_schedule_stays_on_the_grid(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: None  # never answers
    await start(nursery, h, [PEER_B])
    await trio.sleep(9.9)
    [status] = h.supervisor.status()
    assert status["state"] == "unknown"
    await trio.sleep(0.2)  # t = 10.1: the 10 s budget expired at t = 10
    [status] = h.supervisor.status()
    assert status["state"] == "down" and status["last_error"] == "timeout"
    await trio.sleep(20.0)
    # The tick at 5 s fell inside the first exchange's budget and was skipped.
    assert h.link(PEER_B).started_at == [0.0, 10.0, 20.0, 30.0]


async def test_an_exchange_that_overruns_the_interval_is_followed_by_the_next_at_once(autojump_clock,
                                                                                     nursery):
    # The one overrun policy (gridd/link/periodic.py): a 7 s exchange on a 5 s interval
    # ends past the next start, so the next poll starts when it ends, never overlapping.
    h = Harness()
    h.scripts["b"] = lambda n: (7.0, []) if n == 0 else []
    await start(nursery, h, [PEER_B])
    await trio.sleep(17.5)
    assert h.link(PEER_B).started_at == [0.0, 7.0, 12.0, 17.0]


async def test_one_hanging_peer_does_not_delay_another(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: None
    h.scripts["c"] = lambda n: [batch(site="c", seq=n + 1)]
    await start(nursery, h, [PEER_B, PEER_C])
    await trio.sleep(15.5)
    assert h.link(PEER_C).started_at == [0.0, 5.0, 10.0, 15.0]
    assert h.holdings.get("c", "m").batch.revision.batch_sequence == 4
    states = {s["site"]: s["state"] for s in h.supervisor.status()}
    assert states == {"b": "down", "c": "up"}


# --- admission ------------------------------------------------------------------------------


async def test_accepted_batches_are_held_with_their_age(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: [batch(age_s=1.5)]
    await start(nursery, h, [PEER_B])
    await trio.sleep(0.1)
    held = h.holdings.get("b", "m")
    assert held is not None and held.held_since == 0.0
    assert held.age_s(trio.current_time()) == pytest.approx(1.6)
    assert h.supervisor.status()[0]["batches"] == {"accepted": 1, "repeat": 0, "dropped": 0}


async def test_a_repeat_leaves_the_held_age_unchanged(autojump_clock, nursery):
    h = Harness()
    # The same publication every poll, relayed with a growing age.
    h.scripts["b"] = lambda n: [batch(age_s=1.0 + 5.0 * n)]
    await start(nursery, h, [PEER_B])
    await trio.sleep(10.5)
    held = h.holdings.get("b", "m")
    assert held.held_since == 0.0 and held.batch.age_s == 1.0  # the first delivery, not re-held
    assert held.age_s(trio.current_time()) == pytest.approx(11.5)
    assert h.supervisor.status()[0]["batches"] == {"accepted": 1, "repeat": 2, "dropped": 0}
    assert sum(h.fences.drops().values()) == 0  # a repeat is not a drop


async def test_skewed_epoch_is_dropped_and_counted(autojump_clock, nursery):
    h = Harness()
    ahead = int(WALL0) + 601  # more than the 600 s bound ahead of the receiver's wall clock
    h.scripts["b"] = lambda n: [batch(epoch=ahead), batch(provider="ok")]
    await start(nursery, h, [PEER_B])
    await trio.sleep(0.1)
    assert h.holdings.get("b", "m") is None
    assert h.holdings.get("b", "ok") is not None
    assert h.drops("skew") == 1
    assert [e.publisher_epoch for e in h.fences.skew_evidence()] == [ahead]


async def test_a_peer_claiming_another_sites_batches_is_dropped(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: [batch(site="c"), batch(site="a"), batch(site="b")]
    await start(nursery, h, [PEER_B])
    await trio.sleep(0.1)
    assert h.drops("identity") == 2
    assert [held.batch.site for held, _ in h.holdings.latest()] == ["b"]


async def test_an_older_sequence_is_dropped_as_stale(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: [batch(seq=[5, 3][min(n, 1)])]
    await start(nursery, h, [PEER_B])
    await trio.sleep(5.1)
    assert h.drops("stale_order") == 1
    assert h.holdings.get("b", "m").batch.revision.batch_sequence == 5


async def test_decode_errors_are_counted_as_ingest_drops(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: ChannelError("undecodable frame", reason="decode")
    await start(nursery, h, [PEER_B])
    await trio.sleep(5.1)
    assert h.drops("decode") == 2
    assert h.supervisor.status()[0]["last_error"] == "decode"


# --- state changes and status -----------------------------------------------------------------


async def test_state_changes_are_logged_once(autojump_clock, nursery, caplog):
    caplog.set_level(logging.INFO, logger="gridd.operator.peers")
    h = Harness()
    # Up, then refused three times running, then up again.
    h.scripts["b"] = lambda n: ChannelError("refused (forbidden)", reason="refused") if 1 <= n <= 3 else []
    await start(nursery, h, [PEER_B])
    await trio.sleep(25.1)
    lines = [r.getMessage() for r in caplog.records if "peer b" in r.getMessage()]
    assert len(lines) == 3
    assert "is up" in lines[0] and "is down (refused)" in lines[1] and "is up" in lines[2]
    [status] = h.supervisor.status()
    assert status["state"] == "up" and status["failures"] == 3 and status["polls"] == 6
    assert status["last_success_age_s"] == pytest.approx(0.1)
    assert status["last_error"] is None and status["connections"] == 1


async def test_a_new_failure_reason_while_down_is_logged_once(autojump_clock, nursery, caplog):
    caplog.set_level(logging.INFO, logger="gridd.operator.peers")
    h = Harness()
    reasons = ["connect", "connect", "identity", "identity", "identity"]
    h.scripts["b"] = lambda n: ChannelError("no", reason=reasons[min(n, 4)])
    await start(nursery, h, [PEER_B])
    await trio.sleep(20.1)
    lines = [r.getMessage() for r in caplog.records if "peer b" in r.getMessage()]
    assert len(lines) == 2
    assert "is down (connect)" in lines[0] and "still down, now (identity)" in lines[1]


async def test_a_flapping_peer_cannot_flood_the_log(autojump_clock, nursery, caplog):
    caplog.set_level(logging.INFO, logger="gridd.operator.peers")
    h = Harness()
    # Polls at +0, +5, +10, ...: up on even polls, refused on odd ones, for two minutes.
    h.scripts["b"] = lambda n: ChannelError("no", reason="refused") if n % 2 else []
    await start(nursery, h, [PEER_B])
    await trio.sleep(120.1)
    lines = [r.getMessage() for r in caplog.records if "peer b" in r.getMessage()]
    # 25 polls, 24 changes: 4 lines a minute (gridd/core/transitions.py defaults), the first
    # allowed again says how many changes went unlogged.
    assert lines == [
        "peer b (wss://127.0.0.1:9001/signals) is up",
        "peer b (wss://127.0.0.1:9001/signals) is down (refused): no",
        "peer b (wss://127.0.0.1:9001/signals) is up",
        "peer b (wss://127.0.0.1:9001/signals) is down (refused): no",
        "peer b (wss://127.0.0.1:9001/signals) is up (8 more changes not logged: flapping)",
        "peer b (wss://127.0.0.1:9001/signals) is down (refused): no",
        "peer b (wss://127.0.0.1:9001/signals) is up",
        "peer b (wss://127.0.0.1:9001/signals) is down (refused): no",
        "peer b (wss://127.0.0.1:9001/signals) is up (8 more changes not logged: flapping)",
    ]
    # A poller restarted by a reload keeps the peer's budget: the supervisor owns it.
    assert h.supervisor.tasks[(PEER_B.site, PEER_B.url)].poller.transitions is h.supervisor.transitions


# --- reload -------------------------------------------------------------------------------------


async def test_reload_restarts_only_the_changed_poller(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: [batch(site="b", seq=n + 1)]
    h.scripts["c"] = lambda n: [batch(site="c", seq=n + 1)]
    await start(nursery, h, [PEER_B, PEER_C])
    await trio.sleep(7.0)
    task_b = h.supervisor.tasks[("b", PEER_B.url)]
    old_c = h.supervisor.tasks[("c", PEER_C.url)]
    moved_c = PeerConfig(site="c", url="wss://127.0.0.1:9003/signals")
    b_with_ingress = PeerConfig(site="b", url=PEER_B.url, ingress="http://127.0.0.1:8001")

    started = h.supervisor.update([b_with_ingress, moved_c])
    assert started == [("c", moved_c.url)]
    assert h.supervisor.tasks[("b", PEER_B.url)] is task_b
    assert not task_b.scope.cancel_called and task_b.peer.ingress == "http://127.0.0.1:8001"
    assert old_c.scope.cancel_called and ("c", PEER_C.url) not in h.supervisor.tasks
    await trio.sleep(5.5)  # t = 12.5
    # b kept its schedule and its link (no re-dial); the new c started at once.
    assert h.link(PEER_B).started_at == [0.0, 5.0, 10.0] and len(h.links[("b", PEER_B.url)]) == 1
    assert h.link(moved_c).started_at == [7.0, 12.0]  # its own schedule, from its start
    # Shared state survived: c's fence and holdings carried over, so the new poller's
    # first batch (sequence 1 again) is behind the fence.
    assert h.holdings.get("c", "m").batch.revision.batch_sequence == 2
    assert h.drops("stale_order") == 1


async def test_new_tls_material_restarts_every_poller(autojump_clock, nursery):
    h = Harness()
    await start(nursery, h, [PEER_B, PEER_C])
    await trio.sleep(1.0)
    before = dict(h.supervisor.tasks)
    assert h.supervisor.update([PEER_B, PEER_C], restart_all=True) == [("b", PEER_B.url), ("c", PEER_C.url)]
    assert all(task.scope.cancel_called for task in before.values())
    assert all(h.supervisor.tasks[key] is not task for key, task in before.items())
    await trio.sleep(0.1)
    assert len(h.links[("b", PEER_B.url)]) == 2 and len(h.links[("c", PEER_C.url)]) == 2


async def test_removed_peer_stops_polling(autojump_clock, nursery):
    h = Harness()
    await start(nursery, h, [PEER_B, PEER_C])
    await trio.sleep(1.0)
    h.supervisor.update([PEER_B])
    await trio.sleep(10.0)
    assert h.link(PEER_C).started_at == [0.0]
    assert [s["site"] for s in h.supervisor.status()] == ["b"]


# --- expiry -------------------------------------------------------------------------------------


async def test_a_silent_peers_readings_expire_after_the_ttl(autojump_clock, nursery):
    h = Harness()
    h.scripts["b"] = lambda n: [batch(age_s=2.0)] if n == 0 else ChannelError("lost", reason="connect")
    h.holdings.hold(batch(site="a", provider="own"), 0.0)  # the operator's own site is never expired
    await start(nursery, h, [PEER_B])
    # Relayed (stale) until 2 x the 20 s TTL: age 2 + 38 - 0.01 < 40 s
    await trio.sleep(38.0 - 0.01)
    assert h.holdings.get("b", "m") is not None
    await trio.sleep(1.02)  # the next expiry pass after the age passed 40 s
    assert h.holdings.get("b", "m") is None
    assert h.holdings.get("a", "own") is not None


# --- OperatorService wiring (real TLS files, real clock) ---------------------------------------

OPERATOR_CONFIG = """
role: operator
site: a
state_dir: state
tls: {{ca: certs/ca.pem, cert: certs/{cert}.pem, key: certs/{key}-key.pem}}
listen: {{signals: "127.0.0.1:0"}}
peers:
{peers}
timings: {{peer_poll_interval_s: 5, peer_poll_budget_s: 10}}
"""


def operator_config(tmp_path: Path, *, cert: str = "a-operator", key: str | None = None,
                    peers: tuple[PeerConfig, ...] = (PEER_B, PEER_C), name: str = "a.yaml"):
    lines = "\n".join(f"  - {{site: {p.site}, url: \"{p.url}\"}}" for p in peers) or "  []"
    path = tmp_path / name
    path.write_text(OPERATOR_CONFIG.format(cert=cert, key=key or cert, peers=lines))
    return load_config(path, env={})


async def test_operator_refuses_to_start_with_mismatched_tls(tmp_path):
    write_certs(tmp_path / "certs")
    service = OperatorService(operator_config(tmp_path, cert="b-operator"), CollectorRegistry())
    with pytest.raises(TLSMaterialError, match="does not match expected site 'a'"):
        await service.run()


async def test_operator_refuses_signals_without_tls(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text('role: operator\nsite: a\nstate_dir: state\nlisten: {signals: "127.0.0.1:0"}\n')
    with pytest.raises(ConfigError, match="listen.signals: the signals channel is mutual TLS only"):
        await OperatorService(load_config(path, env={}), CollectorRegistry()).run()


async def test_reload_swaps_tls_and_restarts_only_what_changed(tmp_path, nursery):
    write_certs(tmp_path / "certs")
    service = OperatorService(operator_config(tmp_path), CollectorRegistry())
    await nursery.start(service.run)
    assert service.signals_address is not None and service.signals_address.startswith("127.0.0.1:")
    first = dict(service.peers.tasks)
    old_tls = service.tls

    # A key that does not match its certificate: the reload is rejected, nothing changes.
    with pytest.raises(TLSMaterialError) as err:
        await service.stage(operator_config(tmp_path, cert="a-operator", key="a-operator-2", name="bad.yaml"))
    assert err.value.reason == "key_mismatch"
    assert service.tls is old_tls and service.peers.tasks == first

    # Only peer c moves: only its poller restarts.
    moved_c = PeerConfig(site="c", url="wss://127.0.0.1:9003/signals")
    service.commit(await service.stage(operator_config(tmp_path, peers=(PEER_B, moved_c), name="moved.yaml")))
    assert service.peers.tasks[("b", PEER_B.url)] is first[("b", PEER_B.url)]
    assert first[("c", PEER_C.url)].scope.cancel_called
    assert ("c", moved_c.url) in service.peers.tasks

    # Rotated certificate: new contexts for new connections, every poller restarted.
    before = dict(service.peers.tasks)
    service.commit(await service.stage(operator_config(tmp_path, cert="a-operator-2", peers=(PEER_B, moved_c),
                                                       name="rotated.yaml")))
    assert service.tls is not old_tls
    assert service.server_context() is service.tls.material.server_context
    assert all(task.scope.cancel_called for task in before.values())

    # Moving the listener needs a restart.
    with pytest.raises(ConfigError, match="listen.signals: changed"):
        text = (tmp_path / "rotated.yaml").read_text().replace("127.0.0.1:0", "127.0.0.1:1")
        (tmp_path / "listen.yaml").write_text(text)
        await service.stage(load_config(tmp_path / "listen.yaml", env={}))

    peers = {p["site"]: p for p in service.status()["peers"]}
    assert set(peers) == {"b", "c"} and peers["c"]["url"] == moved_c.url
    assert service.status()["signals"]["listen"] == service.signals_address


# --- per-peer bounds (docs/security.md; gridd.core.peer_intake) ---------------------------


async def test_a_peer_flooding_new_names_is_held_to_its_provider_cap(autojump_clock, nursery):
    """The issue's flood: thousands of new provider names per poll grew the operator without
    bound. At most limits.peer_max_providers names per peer are held; the rest are refused."""
    h = Harness()
    h.supervisor.limits = lambda: LimitsConfig(peer_max_providers=100)
    h.scripts["b"] = lambda n: [batch(provider=f"p{n}-{i}", seq=n + 1) for i in range(150)]
    await start(nursery, h, [PEER_B])
    await trio.testing.wait_all_tasks_blocked()
    [status] = h.supervisor.status()
    assert status["batches"] == {"accepted": 100, "repeat": 0, "dropped": 50}
    assert status["refused"] == {"name_length": 0, "provider_cap": 50}
    assert len(h.fences) == 100 and len(h.holdings) == 100
    await trio.sleep_until(5.0)  # the second poll: 150 more new names, every one over the cap
    await trio.testing.wait_all_tasks_blocked()
    [status] = h.supervisor.status()
    assert status["refused"]["provider_cap"] == 200 and len(h.fences) == 100 and len(h.holdings) == 100
    assert h.fences.fence("b", "p1-0") is None


async def test_names_a_peer_stopped_sending_are_forgotten_after_2_ttl(autojump_clock, nursery):
    h = Harness(TimingConfig(signal_ttl_s=20.0))
    h.supervisor.limits = lambda: LimitsConfig(peer_max_providers=2)
    # Poll 0 (t=0) sends two names; polls 1.. send nothing but "late" (refused until room).
    h.scripts["b"] = lambda n: ([batch(provider="x", seq=1), batch(provider="y", seq=1)] if n == 0
                                else [batch(provider="late", seq=n)])
    await start(nursery, h, [PEER_B])
    await trio.sleep_until(40.0)
    await trio.testing.wait_all_tasks_blocked()
    # At 2 x TTL exactly, still kept (x and y are 40 s old, not older)...
    assert h.fences.fence("b", "x") is not None and h.fences.fence("b", "late") is None
    # ...the expiry pass at t = 41 forgets them, fences included: the next poll (t = 45) has room.
    await trio.sleep_until(41.0)
    await trio.testing.wait_all_tasks_blocked()
    assert h.fences.fence("b", "x") is None and h.fences.fence("b", "y") is None and len(h.fences) == 0
    await trio.sleep_until(45.0)
    await trio.testing.wait_all_tasks_blocked()
    assert h.fences.fence("b", "late") is not None


@pytest.mark.parametrize(("site", "provider", "refused"), [
    ("b", "p" * 255, None), ("b", "p" * 256, "name_length"), ("b" * 256, "p", "name_length"),
])
async def test_names_longer_than_255_characters_are_refused(autojump_clock, nursery, site, provider, refused):
    h = Harness()
    h.scripts["b"] = lambda n: [batch(site=site, provider=provider)] if n == 0 else []
    await start(nursery, h, [PEER_B])
    await trio.testing.wait_all_tasks_blocked()
    [status] = h.supervisor.status()
    if refused is None:
        assert status["batches"]["accepted"] == 1 and len(h.fences) == 1
    else:
        assert status["refused"][refused] == 1 and len(h.fences) == 0 and h.drops("identity") == 0


# --- the link layer's loop and supervisor (gridd/link) ------------------------------------------


async def test_periodic_runs_start_to_start_and_an_overrun_starts_the_next_at_once(autojump_clock, nursery):
    durations = iter([0.25, 1.75, 0.25, 0.25, 0.25, 0.25])
    starts: list[float] = []

    async def body() -> None:
        starts.append(trio.current_time())
        await trio.sleep(next(durations))

    nursery.start_soon(run_periodic, lambda: 1.0, body)
    await trio.sleep(4.8)
    # +2 fell inside the 1.75 s run: the next started when it ended, and the schedule goes
    # on from there (missed starts are not made up in a burst).
    assert starts == [0.0, 1.0, 2.75, 3.75, 4.75]


async def test_periodic_a_late_wake_up_does_not_shift_the_schedule(mock_clock, nursery):
    """The scrape loop used to schedule from when it actually woke (a drift of the wake-up
    latency every pass); every loop now schedules from the previous scheduled start."""
    starts: list[float] = []

    async def body() -> None:
        starts.append(trio.current_time())

    nursery.start_soon(run_periodic, lambda: 1.0, body)
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(1.3)  # the loop wakes 0.3 s late for its start at +1
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(0.7)
    await trio.testing.wait_all_tasks_blocked()
    assert starts == [0.0, 1.3, 2.0]
    assert [next_start(1.0, 1.0, 1.3), next_start(1.0, 1.0, 2.5)] == [2.0, 2.5]


async def test_periodic_reads_the_interval_anew_after_each_start(autojump_clock, nursery):
    intervals = iter([1.0, 2.0, 3.0])
    starts: list[float] = []

    async def body() -> None:
        starts.append(trio.current_time())

    nursery.start_soon(run_periodic, lambda: next(intervals, 3.0), body)
    await trio.sleep(9.5)
    assert starts == [0.0, 1.0, 3.0, 6.0, 9.0]


async def test_supervisor_restarts_stops_and_restarts_a_failed_task_after_its_delay(autojump_clock, nursery,
                                                                                   caplog):
    supervisor: TaskSupervisor[str] = TaskSupervisor(restart_delay_s=lambda: 2.0,
                                                     log=logging.getLogger("gridd.test"))
    await nursery.start(supervisor.run)
    runs: list[tuple[str, float]] = []

    def body(name: str, fail: bool = False):
        async def run() -> None:
            runs.append((name, trio.current_time()))
            if fail:
                raise RuntimeError("bug")
            await trio.sleep_forever()
        return run

    scope = supervisor.start("a", body("a"), label="task a")
    supervisor.start("b", body("b", fail=True), label="task b")
    await trio.sleep(1.0)
    assert supervisor.restart("a") and scope.cancel_called and supervisor.restarts == 1
    await trio.sleep(3.5)  # t = 4.5: b failed at 0, 2, 4 (restarted 2 s after each failure)
    assert sorted(runs, key=lambda r: (r[1], r[0])) == [
        ("a", 0.0), ("b", 0.0), ("a", 1.0), ("b", 2.0), ("b", 4.0)]
    failures = [r.getMessage() for r in caplog.records if r.name == "gridd.test"]
    assert failures == ["task b failed; restarting it"] * 3
    assert supervisor.stop("b") and not supervisor.stop("b") and supervisor.keys() == ["a"]
    await trio.sleep(5.0)
    assert runs[-1] == ("b", 4.0) and not supervisor.restart("b")
