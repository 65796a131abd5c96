"""Site selection on the request path (spec: Site Selection).

:func:`pick` reads one :class:`~gridd.core.ordering.OrderedSnapshot` and a
``random.Random``; it never reads raw signals. Rules, in order:

1. Healthy sites with room (fresh, rho < 1):
   - three or more: draw two distinct sites, each draw with probability proportional to
     capacity among the sites not yet drawn, and take the one with the lower rho (the
     first drawn on a tie);
   - two: take site i with probability (c_i / (1 + rho_i)) / sum_j (c_j / (1 + rho_j));
   - one: take it.
2. No site with room: the highest capacity among fresh sites not full, ties to the lower
   queue depth; failing that, the highest-capacity stale site (stale sorts last but is
   still used when nothing better is left).
3. Every healthy site full: :class:`Full`, carrying the route to use when the model does
   not shed (highest capacity among all healthy, ties to the lower queue depth).
4. No healthy site: :class:`NoneHealthy` (503 with Retry-After) when the model has
   excluded candidates, :class:`NoCandidates` (404) when it has none at all.

A site with no healthy endpoint is excluded from the snapshot, so it is never picked
while a healthy one is left.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from typing import Literal

import msgspec

from gridd.core.ordering import CandidateView, OrderedSnapshot

Via = Literal["two_choices", "pair", "single", "not_full", "stale", "full"]


class Route(msgspec.Struct, frozen=True):
    """Forward to this candidate. via: which rule chose it (a metric label)."""

    site: str
    provider: str
    model: str
    local: bool
    via: Via


class Full(msgspec.Struct, frozen=True):
    """Every healthy site is saturated with work waiting. The caller answers 429 only when
    the model's shedding state says it sheds; otherwise it forwards to ``route``."""

    route: Route


class NoneHealthy(msgspec.Struct, frozen=True):
    """The model exists but no candidate is healthy: 503 with Retry-After (caller jitters)."""

    retry_after_s: float
    excluded: int


class NoCandidates(msgspec.Struct, frozen=True):
    """No site serves the model at all: 404."""


Outcome = Route | Full | NoneHealthy | NoCandidates


def _route(view: CandidateView, via: Via) -> Route:
    return Route(view.site, view.provider, view.model, view.local, via)


def pick(snapshot: OrderedSnapshot, rng: random.Random) -> Outcome:
    room = snapshot.room
    n = len(room)
    if n >= 3:
        # Two distinct draws proportional to capacity. First draw: u uniform on
        # [0, total), site i where cum[i-1] <= u < cum[i]. Second draw: v uniform on
        # [0, total - c_i), laid over the same line with site i's segment cut out, so
        # P(j | i) = c_j / (total - c_i) exactly, with no rejection loop.
        cum = snapshot.room_cum
        total = snapshot.room_total
        i = bisect_right(cum, rng.random() * total)
        if i >= n:
            i = n - 1
        c_i = snapshot.room_capacity[i]
        v = rng.random() * (total - c_i)
        start_i = cum[i - 1] if i else 0.0
        if v >= start_i:
            v = cum[i] + (v - start_i)
        j = bisect_right(cum, v)
        if j >= n:
            j = n - 1
        if j == i:
            # Only reachable through float rounding at the very end of the line, where
            # the clamp above lands on the last site and that site was drawn first.
            j = i - 1
        first, second = room[i], room[j]
        return _route(second if second.rho < first.rho else first, "two_choices")
    if n == 2:
        return _route(room[0] if rng.random() < snapshot.pair_first_p else room[1], "pair")
    if n == 1:
        return _route(room[0], "single")
    if snapshot.fallback is not None:
        return _route(snapshot.fallback, "stale" if snapshot.fallback_stale else "not_full")
    if snapshot.overflow is not None:
        return Full(_route(snapshot.overflow, "full"))
    if snapshot.excluded:
        return NoneHealthy(snapshot.none_healthy_retry_after_s, len(snapshot.excluded))
    return NoCandidates()
