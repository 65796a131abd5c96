"""Ordering: each candidate's recent worst load into one immutable least-loaded-first
snapshot per model (spec: The Poll Path).

Ordering runs off the request path, after each ingest. The request path reads one
:class:`OrderedSnapshot` and calls :func:`gridd.core.selection.pick` on it; it never reads
raw signals or computes load. Everything a pick needs that does not depend on the request
(the room list, cumulative capacity weights, the pair weight, the no-room and overflow
choices) is worked out here, once per snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from gridd.core.capacity import CapacityLearner, queue_depth, saturated_with_work_waiting
from gridd.core.readings import LoadSignals

DEFAULT_NONE_HEALTHY_RETRY_AFTER_S = 5.0


class CandidateView(msgspec.Struct, frozen=True):
    """What ordering and selection know of one candidate at one instant.

    capacity: the learned bound (requests), > 0; the weight selection draws by.
    rho: the recent worst smoothed saturation (ordering's load score).
    healthy: not excluded (ready, a non-zero ready count, per-unit series still coming).
        An unhealthy candidate is never picked but is remembered: 503, not 404.
    full: saturated with work waiting, from the latest sample
        (:func:`gridd.core.capacity.saturated_with_work_waiting`).
    queue_depth: requests waiting (unit queues + flow control); breaks capacity ties.
    stale: no fresh reading (missing, stale, never written). Scored as maximally loaded:
        sorts after every candidate with a reading, has no room, is not excluded.
    local: served by this gateway's own site.
    """

    site: str
    provider: str
    model: str
    capacity: float
    rho: float
    healthy: bool = True
    full: bool = False
    queue_depth: float = 0.0
    stale: bool = False
    local: bool = False


def candidate_view(
    *,
    site: str,
    provider: str,
    model: str,
    learner: CapacityLearner,
    load: LoadSignals | None,
    now: float,
    healthy: bool,
    local: bool,
    fresh: bool = True,
) -> CandidateView:
    """Build a candidate's view from its learner and its latest load.

    fresh: the store holds a reading of this candidate within the signal TTL. A
    candidate with no fresh reading, or whose every rho sample has aged out of the recent
    window, is stale: rho is +inf and it is never full (its state is unknown, not known
    saturated).
    """
    worst = learner.recent_worst_rho(now)
    stale = not fresh or load is None or worst is None
    return CandidateView(
        site=site,
        provider=provider,
        model=model,
        capacity=learner.bound,
        rho=math.inf if stale else worst,
        healthy=healthy,
        full=False if stale else saturated_with_work_waiting(learner.rho, load),
        queue_depth=queue_depth(load),
        stale=stale,
        local=local,
    )


def _load_score(view: CandidateView) -> float:
    # Failure Behavior: a missing or stale reading scores as maximally loaded.
    if view.stale or math.isnan(view.rho):
        return math.inf
    return view.rho


def _order_key(view: CandidateView) -> tuple[float, float, float, str, str]:
    return (_load_score(view), -view.capacity, view.queue_depth, view.site, view.provider)


def _capacity_key(view: CandidateView) -> tuple[float, float, str, str]:
    # "by capacity ..., tied on queue depth"; site and provider make the rest deterministic.
    return (-view.capacity, view.queue_depth, view.site, view.provider)


class OrderedSnapshot:
    """One model's resolved order. Immutable once built; safe to share across tasks.

    model: the model name.
    ordered: healthy candidates, least loaded first (recent worst rho ascending, then
        higher capacity, lower queue depth, site, provider); stale ones last.
    excluded: unhealthy candidates, never picked; non-empty with ``ordered`` empty
        means 503 (the model exists but cannot be served now), both empty means unknown.
    room: the candidates of ``ordered`` with room (fresh, rho < 1), in the same order.
    room_capacity: their capacities; room_cum: running sums; room_total: their sum.
    pair_first_p: with exactly two in ``room``, the chance of room[0]:
        w0 / (w0 + w1) with w = capacity / (1 + rho).
    fallback: the no-room pick (fresh and not full, else stale), or None.
    fallback_stale: the fallback is a stale candidate.
    overflow: the candidate routed to when every healthy one is full, or None.
    all_full: every healthy candidate is fresh and full (shedding's "every healthy site
        saturated with work waiting"); False when none is healthy.
    any_full: some healthy, fresh candidate is full.
    none_healthy_retry_after_s: the Retry-After hint when no candidate is healthy.
    """

    __slots__ = (
        "model", "ordered", "excluded", "room", "room_capacity", "room_cum", "room_total",
        "pair_first_p", "fallback", "fallback_stale", "overflow", "all_full", "any_full",
        "none_healthy_retry_after_s",
    )

    model: str
    ordered: tuple[CandidateView, ...]
    excluded: tuple[CandidateView, ...]
    room: tuple[CandidateView, ...]
    room_capacity: tuple[float, ...]
    room_cum: tuple[float, ...]
    room_total: float
    pair_first_p: float
    fallback: CandidateView | None
    fallback_stale: bool
    overflow: CandidateView | None
    all_full: bool
    any_full: bool
    none_healthy_retry_after_s: float

    def __init__(self, **fields: object) -> None:
        for name in self.__slots__:
            object.__setattr__(self, name, fields[name])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("OrderedSnapshot is immutable; build a new one")

    def __repr__(self) -> str:
        return (f"OrderedSnapshot(model={self.model!r}, ordered={len(self.ordered)}, "
                f"room={len(self.room)}, excluded={len(self.excluded)})")


def build_snapshot(
    model: str,
    views: Iterable[CandidateView],
    *,
    none_healthy_retry_after_s: float = DEFAULT_NONE_HEALTHY_RETRY_AFTER_S,
) -> OrderedSnapshot:
    """Order one model's candidates and precompute every request-independent part of a pick."""
    pickable: list[CandidateView] = []
    excluded: list[CandidateView] = []
    for view in views:
        if view.model != model:
            raise ValueError(f"candidate {view.site}/{view.provider} serves {view.model!r}, not {model!r}")
        if not (math.isfinite(view.capacity) and view.capacity > 0):
            raise ValueError(f"candidate {view.site}/{view.provider} has capacity {view.capacity!r}; must be > 0")
        (pickable if view.healthy else excluded).append(view)
    pickable.sort(key=_order_key)
    excluded.sort(key=_order_key)

    # Site Selection: "a site has room while rho is below 1"; a stale one has no reading,
    # so it is maximally loaded and never has room.
    room = tuple(v for v in pickable if not v.stale and v.rho < 1.0)
    capacities = tuple(v.capacity for v in room)
    cum: list[float] = []
    total = 0.0
    for c in capacities:
        total += c
        cum.append(total)

    pair_first_p = 1.0
    if len(room) == 2:
        w0 = room[0].capacity / (1.0 + room[0].rho)
        w1 = room[1].capacity / (1.0 + room[1].rho)
        pair_first_p = w0 / (w0 + w1)

    # No room anywhere: "the pick is by capacity among sites not full, tied on queue
    # depth". Fresh candidates that are not full come first; a stale one has no reading
    # and sorts after every candidate that has one, but is still used before a full one.
    fresh_not_full = [v for v in pickable if not v.stale and not v.full]
    stale = [v for v in pickable if v.stale]
    fallback: CandidateView | None = None
    fallback_stale = False
    if fresh_not_full:
        fallback = min(fresh_not_full, key=_capacity_key)
    elif stale:
        fallback = min(stale, key=_capacity_key)
        fallback_stale = True
    all_full = bool(pickable) and fallback is None
    # Every healthy candidate full: the pick reports Full; when the model does not shed
    # (shedding off, or its timer has not run out) the request still goes to the highest
    # capacity, tied on queue depth.
    overflow = min(pickable, key=_capacity_key) if all_full else None

    return OrderedSnapshot(
        model=model,
        ordered=tuple(pickable),
        excluded=tuple(excluded),
        room=room,
        room_capacity=capacities,
        room_cum=tuple(cum),
        room_total=total,
        pair_first_p=pair_first_p,
        fallback=fallback,
        fallback_stale=fallback_stale,
        overflow=overflow,
        all_full=all_full,
        any_full=any(v.full and not v.stale for v in pickable),
        none_healthy_retry_after_s=none_healthy_retry_after_s,
    )
