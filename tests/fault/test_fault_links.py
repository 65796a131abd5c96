"""Links between sites failing: a cut (cable pulled), a slow signals link beyond the peer-poll
budget, a peer operator that accepts TCP and never answers (SIGSTOP). Two sites on network
namespaces of their own (netgrid.py), clients in each site's namespace.

Bounds (timings of netgrid.TIMINGS: peer poll 1 s with a 2 s budget, signal TTL 4 s, the
gateway's poll 1 s): a reading goes stale TTL after it was published and silent at 2 x TTL;
the gateway learns it at its next poll. A site's last reading at the moment of a fault is at
most one peer poll + one scrape old. SLACK_S covers a loaded 2-core machine (the gridctl
status read itself takes ~0.3 s)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from realproc import wait_until

from fault.netgrid import TTL_S, Load, series, wait_signal

pytestmark = pytest.mark.realproc

PEER_POLL_S, PEER_BUDGET_S, GATEWAY_POLL_S, SCRAPE_S = 1.0, 2.0, 1.0, 1.0
SLACK_S = 3.0
STALE_BOUND_S = TTL_S + PEER_POLL_S + SCRAPE_S + GATEWAY_POLL_S + SLACK_S
SILENT_BOUND_S = 2 * TTL_S + PEER_POLL_S + SCRAPE_S + GATEWAY_POLL_S + SLACK_S
# Back: the next peer poll (an interval, plus a budget for one that was under way when the
# fault ended), then the gateway's next poll.
REJOIN_BOUND_S = PEER_POLL_S + PEER_BUDGET_S + GATEWAY_POLL_S + SLACK_S


def only_local(load: Load, site: str, since: float, until: float) -> dict[str, int]:
    served = load.served_by(since, until)
    assert served and set(served) == {f"{site}/pool-{site}"}, served
    return served


def probe(grid, site: str, seconds: float) -> Load:
    """Fresh clients for ``seconds``: where new requests go now (the running load's workers
    may be held by requests that went out before a fault)."""
    with Load(grid, site, workers=2) as load:
        time.sleep(seconds)
    assert load.wrong() == [], load.wrong()[:3]
    return load


def test_a_cut_link_sorts_the_other_site_last_then_excludes_it_and_it_rejoins(make_grid):
    with make_grid() as grid, Load(grid, "a", workers=3, timeout_s=90) as load_a, \
            Load(grid, "b", workers=3, timeout_s=90) as load_b:
        time.sleep(2)
        assert set(load_a.served_by(0)) == {"a/pool-a", "b/pool-b"}  # both sites share a's traffic
        cut = time.monotonic()
        grid.cut("b")
        stale_a = wait_signal(grid, "a", "b", "stale", cut, STALE_BOUND_S)
        wait_signal(grid, "b", "a", "stale", cut, STALE_BOUND_S)
        silent_a = wait_signal(grid, "a", "b", "silent", cut, SILENT_BOUND_S)
        assert grid.candidates("a")["b"]["excluded"] == "silent"
        wait_signal(grid, "b", "a", "silent", cut, SILENT_BOUND_S)
        # Each site routes locally: every new request is served at home (stale sorts after
        # every fresh candidate, silent is excluded).
        for site in ("a", "b"):
            only_local(probe(grid, site, 2), site, 0, time.monotonic())
        peer = grid.status("op-a")["role_status"]["peers"][0]
        assert peer["site"] == "b" and peer["state"] != "up" and peer["failures"] >= 1, peer

        restored = time.monotonic()
        grid.restore("b")
        back_a = wait_signal(grid, "a", "b", "fresh", restored, REJOIN_BOUND_S)
        back_b = wait_signal(grid, "b", "a", "fresh", restored, REJOIN_BOUND_S)
        # b takes a share of a's traffic again.
        rejoined = probe(grid, "a", 3).served_by(0)
        assert rejoined.get("b/pool-b", 0) >= 3, rejoined
        wait_until(lambda: grid.status("op-a")["role_status"]["peers"][0]["state"] == "up", "a's peer b up")
    # Every request was answered 200, none past the client's bound: a request in flight to b
    # when the cable was pulled waits in TCP retransmission and completes after the restore
    # (the front never retries after the request went out; docs/reliability.md).
    for load in (load_a, load_b):
        assert load.wrong() == []
        assert len(load.outcomes) >= 30
    print(f"cut: stale after {stale_a:.1f} s, silent after {silent_a:.1f} s, fresh again {back_a:.1f} s / "
          f"{back_b:.1f} s after the restore; slowest answer {max(o.elapsed for o in load_a.outcomes):.1f} s")


def test_a_signals_link_slower_than_the_peer_poll_budget_goes_stale_and_comes_back(make_grid):
    with make_grid(proxied_peer_link=True) as grid, Load(grid, "a", workers=3) as load:
        time.sleep(1)
        slowed = time.monotonic()
        grid.proxy.delay_s = PEER_BUDGET_S + 1.0  # every exchange with b outlasts the budget
        stale = wait_signal(grid, "a", "b", "stale", slowed, STALE_BOUND_S)
        silent = wait_signal(grid, "a", "b", "silent", slowed, SILENT_BOUND_S)
        peer = grid.status("op-a")["role_status"]["peers"][0]
        assert peer["last_error"] == "timeout" and peer["failures"] >= 2, peer
        only_local(probe(grid, "a", 2), "a", 0, time.monotonic())
        # b's own gateway never noticed: its operator is next to it.
        assert grid.candidates("b")["b"]["signal"] == "fresh"

        healed = time.monotonic()
        grid.proxy.delay_s = 0.0
        back = wait_signal(grid, "a", "b", "fresh", healed,
                           REJOIN_BOUND_S + grid_delay_drain(PEER_BUDGET_S + 1.0))
        assert probe(grid, "a", 3).served_by(0).get("b/pool-b", 0) >= 3
    assert load.wrong() == []
    print(f"slow link: stale after {stale:.1f} s, silent after {silent:.1f} s, "
          f"fresh {back:.1f} s after it healed")


def grid_delay_drain(delay_s: float) -> float:
    """Bytes already queued in the proxy at the old delay still arrive that late."""
    return delay_s


def test_a_peer_operator_that_accepts_tcp_and_never_answers(make_grid):
    """SIGSTOP on b's operator: its kernel still completes TCP handshakes, nothing answers.
    a's polls time out at the budget and b sorts last, then is excluded; b's own gateway
    keeps routing from its last snapshot until the TTL, then answers the designed 503."""
    with make_grid() as grid, Load(grid, "a", workers=3) as load_a, Load(grid, "b", workers=2) as load_b:
        time.sleep(1)
        stopped = time.monotonic()
        os.kill(grid.pid("op-b"), signal.SIGSTOP)
        try:
            stale = wait_signal(grid, "a", "b", "stale", stopped, STALE_BOUND_S)
            silent = wait_signal(grid, "a", "b", "silent", stopped, SILENT_BOUND_S)
            peer = grid.status("op-a")["role_status"]["peers"][0]
            assert peer["last_error"] == "timeout", peer
            # b's gateway: no operator answer within the TTL -> 503 no_routing_data (designed).
            wait_until(lambda: grid.get("b", "http://127.0.0.1:8080/readyz").status_code == 503,
                       "b's gateway not ready without its operator", deadline_s=STALE_BOUND_S + 5)
            only_local(probe(grid, "a", 2), "a", 0, time.monotonic())
        finally:
            os.kill(grid.pid("op-b"), signal.SIGCONT)
        resumed = time.monotonic()
        back = wait_signal(grid, "a", "b", "fresh", resumed, REJOIN_BOUND_S)
        wait_until(lambda: grid.get("b", "http://127.0.0.1:8080/readyz").status_code == 200,
                   "b's gateway ready again", deadline_s=REJOIN_BOUND_S)
        time.sleep(2)
        last_second = load_b.since(time.monotonic() - 1)
        assert last_second and all(o.status == 200 for o in last_second)
        # Nothing b published before the stop was refused as out of order after the resume.
        drops = series(grid.metrics("a"), "grid_signals_ingest_dropped_total")
        assert sum(v for _, v in drops) == 0, drops
    assert load_a.wrong() == [] and load_b.wrong() == []
    unavailable = [o for o in load_b.outcomes if o.status == 503]
    assert unavailable, "b's clients never saw the designed 503 while b's operator was stopped"
    print(f"stopped peer: stale {stale:.1f} s, silent {silent:.1f} s, fresh {back:.1f} s after SIGCONT; "
          f"b's clients: {len(unavailable)} x 503 of {len(load_b.outcomes)}")
