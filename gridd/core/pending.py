"""Pending load: what this gateway sent to a candidate that its latest reading cannot show.

A reading arrives seconds after it was taken (scrape, relay, poll; 5 s more for another
site). Every request a gateway sends in that time is invisible to it, and every gateway
reading the same snapshot sends to the same sites: the classic herd on stale load. So at
each pick, a candidate's rho is raised by this gateway's own sends made after the
candidate's reading was taken:

    extra rho = pending_weight x (sends at t > now - reading age) / capacity

The count is of sends, not of requests still in flight: a send older than the reading is
already in it (or finished), and the gateway keeps no in-flight count of its own (spec:
Site Selection; this is the narrower reading decided by the routing-quality issue, with
the measurements in docs/routing.md). ``pending_weight`` scales the own count to stand
for every gateway's (the gateways that share a site's traffic send alike); 0 turns it
off. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from bisect import bisect_right

Key = tuple[str, str]

DEFAULT_PENDING_WEIGHT = 4.0
"""About the number of gateways whose traffic a site shares; measured with 1 to 4 gateways
per site in the routing simulator (docs/routing.md)."""


class RecentSends:
    """Send times per candidate over the last ``horizon_s`` seconds (a reading older than
    that is stale and scores as maximally loaded anyway)."""

    __slots__ = ("_horizon_s", "_sends")

    def __init__(self, horizon_s: float) -> None:
        self._horizon_s = horizon_s
        self._sends: dict[Key, list[float]] = {}

    def retune(self, horizon_s: float) -> None:
        self._horizon_s = horizon_s

    def record(self, key: Key, now: float) -> None:
        times = self._sends.setdefault(key, [])
        times.append(now)
        if times[0] < now - 2 * self._horizon_s:
            # Amortised pruning: drop everything past the horizon at once.
            del times[:bisect_right(times, now - self._horizon_s)]

    def since(self, key: Key, t: float) -> int:
        """How many sends to ``key`` were made at a time strictly after ``t``."""
        times = self._sends.get(key)
        if not times:
            return 0
        return len(times) - bisect_right(times, t)

    def forget(self, key: Key) -> None:
        self._sends.pop(key, None)
