"""The one periodic loop of gridd: drift-free, with one overrun policy.

Every periodic task (scrape passes, peer polls, the gateway's operator poll, the peer
expiry sweep, systemd watchdog pings) runs on ``run_periodic``. The rules, in one place:

* Drift-free (STYLE 9): each start is scheduled from the previous *scheduled* start, with
  ``trio.sleep_until``; a late wake-up does not shift the schedule.
* Start to start: the interval is read after each iteration, so a committed reload's
  interval applies from the next start.
* Overrun: an iteration that runs past the next start is followed at once by the next one,
  and the schedule continues from there. Iterations never overlap, and missed starts are
  not made up in a burst.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NoReturn

import trio

__all__ = ["next_start", "run_periodic"]


def next_start(scheduled: float, interval_s: float, now: float) -> float:
    """The start after the one that was scheduled at ``scheduled``, the iteration now over."""
    return max(scheduled + interval_s, now)


async def run_periodic(
    interval_s: Callable[[], float],
    body: Callable[[], Awaitable[object]],
    *,
    first_at: float | None = None,
) -> NoReturn:
    """Run ``body`` at ``first_at`` (default: now) and then every ``interval_s()``, until
    cancelled. An exception from ``body`` ends the loop (the caller's supervisor decides)."""
    scheduled = trio.current_time() if first_at is None else first_at
    while True:
        await trio.sleep_until(scheduled)
        await body()
        scheduled = next_start(scheduled, interval_s(), trio.current_time())
