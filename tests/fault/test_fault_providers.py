"""A provider flapping ready/not-ready on the namespaced two-site grid (netgrid.py).

pool-a's simulator alternates between up (2 endpoints, /metrics answering) and down (0
endpoints: every request refused with 503; /metrics hanging, so the operator's scrape times
out). The readiness verdict needs a scrape to go unanswered for the stale bound, here the
readiness floor of 2 s (scrape interval 1 s + the 1 s pass), and the gateway learns it at its
next 1 s poll:

- flapping every 2 s, the provider is never declared not ready (a down phase is over before
  the floor): requests that reach it while down are refused and retried once on site b, so
  every client still gets 200;
- down for several seconds at a time, it is declared not ready, and from the gateway's first poll that
  says so until it is up again, not one request reaches it (checked between two status reads
  that both show it not ready: no flip fits between them, since going ready and back takes
  longer than the floor).
"""

from __future__ import annotations

import time

import httpx
import pytest
from realproc import wait_until

from fault.netgrid import SIM_PORT, Load, inside, total

pytestmark = pytest.mark.realproc

UP = {"endpoints": 2, "metrics_hang": False}
DOWN = {"endpoints": 0, "metrics_hang": True}


def sim(grid, **knobs) -> dict:
    """pool-a's simulator /admin: POST ``knobs`` if any, else GET."""
    with inside(grid.ns["a"]):
        if knobs:
            return httpx.post(f"http://127.0.0.1:{SIM_PORT}/admin", json=knobs, timeout=5).json()
        return httpx.get(f"http://127.0.0.1:{SIM_PORT}/admin", timeout=5).json()


def attempts(grid) -> int:
    """Requests that reached pool-a's simulator: scheduled, or refused before scheduling."""
    state = sim(grid)
    return state["request_total"] + sum(state["errors"].values())


def test_a_flapping_provider_gets_no_request_while_not_ready_beyond_one_poll(make_grid):
    with make_grid() as grid, Load(grid, "a", workers=3) as load:
        # 1. Every 2 s: never declared not ready; refusals are retried on b.
        before = total(grid.metrics("a", "gw"), "gridd_gateway_retries_total")
        flips = 0
        end = time.monotonic() + 10
        while time.monotonic() < end:
            sim(grid, **(DOWN if flips % 2 == 0 else UP))
            flips += 1
            time.sleep(2)
        sim(grid, **UP)
        retried = total(grid.metrics("a", "gw"), "gridd_gateway_retries_total") - before
        assert retried >= 1  # some requests met a down phase, and were retried

        # 2. Down 7 s, up 3 s, twice: while the gateway holds it not ready, nothing reaches it.
        windows = 0
        for _ in range(2):
            wait_until(lambda: grid.candidates("a")["a"]["ready"] is True, "pool-a ready at gateway a")
            sim(grid, **DOWN)
            went_down = time.monotonic()
            wait_until(lambda: grid.candidates("a")["a"]["ready"] is False,
                       "gateway a holding pool-a not ready", deadline_s=10)
            # The verdict: the floor (2 s) after the last answered scrape, then one gateway poll.
            # Down until two windows were checked (at most 15 s: status reads are slow under load).
            checked = windows
            while windows - checked < 2 and time.monotonic() - went_down < 15:
                held_before = grid.candidates("a")["a"]["ready"] is False
                first = attempts(grid)
                time.sleep(0.5)
                second = attempts(grid)
                if held_before and grid.candidates("a")["a"]["ready"] is False:
                    assert second == first, "a request reached pool-a while gateway a held it not ready"
                    windows += 1
            sim(grid, **UP)
        assert windows >= 3, windows
        time.sleep(2)
    assert load.wrong() == [], load.wrong()[:3]
    assert {o.status for o in load.outcomes} == {200}
    print(f"flapping: {flips} flips every 2 s, {retried:.0f} refusals retried on b; {windows} "
          f"not-ready windows with no request reaching pool-a; {len(load.outcomes)} requests, all 200")
