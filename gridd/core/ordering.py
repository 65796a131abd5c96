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
    # The signal TTL decides staleness (the store's `fresh`): a fresh reading whose rho
    # samples all left the (shorter) recent window is read at its latest smoothed rho.
    worst = learner.recent_worst_rho(now)
    if worst is None:
        worst = learner.rho
    stale = not fresh or load is None or worst is None
    return CandidateView(
        site=site,
        provider=provider,
        model=model,
        capacity=learner.bound,
        rho=math.inf if stale or worst is None else worst,  # worst is None only when stale
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


class Tier(msgspec.Struct, frozen=True):
    """Candidates of one preference tier, with what a draw proportional to capacity needs.

    candidates: in order (least loaded first); capacities: theirs; cum: running sums of
    the capacities; total: their sum.
    """

    candidates: tuple[CandidateView, ...] = ()
    capacities: tuple[float, ...] = ()
    cum: tuple[float, ...] = ()
    total: float = 0.0

    @classmethod
    def of(cls, candidates: Iterable[CandidateView]) -> Tier:
        members = tuple(candidates)
        capacities = tuple(v.capacity for v in members)
        cum: list[float] = []
        total = 0.0
        for c in capacities:
            total += c
            cum.append(total)
        return cls(members, capacities, tuple(cum), total)

    def __len__(self) -> int:
        return len(self.candidates)


class OrderedSnapshot(msgspec.Struct, frozen=True):
    """One model's resolved order. Immutable once built; safe to share across tasks.

    Preference tiers (decided by the routing-quality issue, docs/routing.md): room, then
    fresh and not full, then fresh and full, then no fresh signal.

    model: the model name.
    ordered: healthy candidates, least loaded first (recent worst rho ascending, then
        higher capacity, lower queue depth, site, provider); stale ones last.
    excluded: unhealthy candidates, never picked; non-empty with ``ordered`` empty
        means 503 (the model exists but cannot be served now), both empty means unknown.
    fresh: the healthy candidates with a fresh reading, in ``ordered`` order.
    room: the candidates with room (fresh, rho < 1), in ``ordered`` order.
    pair_first_p: with exactly two in ``room``, the chance of the first:
        w0 / (w0 + w1) with w = capacity / (1 + rho).
    not_full: fresh candidates without room that are not full (the no-room tier).
    full: every fresh healthy candidate, when all of them are full (else empty).
    stale: the candidates with no fresh reading, when no fresh healthy one is left (else
        empty): used only when nothing else is.
    all_full: there are fresh healthy candidates and every one is full (shedding's
        "every healthy site saturated with work waiting"); stale ones do not count.
    none_healthy_retry_after_s: the Retry-After hint when no candidate is healthy.
    """

    model: str
    ordered: tuple[CandidateView, ...]
    excluded: tuple[CandidateView, ...]
    fresh: Tier
    room: Tier
    pair_first_p: float
    not_full: Tier
    full: Tier
    stale: Tier
    all_full: bool
    none_healthy_retry_after_s: float

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
            raise ValueError(f"candidate {view.site}/{view.provider} has capacity {view.capacity!r}; "
                             "must be > 0")
        (pickable if view.healthy else excluded).append(view)
    pickable.sort(key=_order_key)
    excluded.sort(key=_order_key)

    # Site Selection: "a site has room while rho is below 1"; a stale one has no reading,
    # so it is maximally loaded and never has room.
    fresh = [v for v in pickable if not v.stale]
    room = Tier.of(v for v in fresh if v.rho < 1.0)
    pair_first_p = 1.0
    if len(room) == 2:
        w0 = room.capacities[0] / (1.0 + room.candidates[0].rho)
        w1 = room.capacities[1] / (1.0 + room.candidates[1].rho)
        pair_first_p = w0 / (w0 + w1)

    # No room anywhere: "the pick is by capacity among sites not full, tied on queue
    # depth". Then every fresh site full (the pick reports Full; when the model does not
    # shed the request still goes to one of them). A stale candidate has no reading: it
    # neither blocks that nor is preferred to a site known full; it is used only when no
    # fresh healthy candidate is left.
    not_full = Tier.of(v for v in fresh if v.rho >= 1.0 and not v.full)
    all_full = bool(fresh) and all(v.full for v in fresh)
    full = Tier.of(fresh) if all_full else Tier()
    stale = Tier.of(v for v in pickable if v.stale) if not fresh else Tier()

    return OrderedSnapshot(
        model=model,
        ordered=tuple(pickable),
        excluded=tuple(excluded),
        fresh=Tier.of(fresh),
        room=room,
        pair_first_p=pair_first_p,
        not_full=not_full,
        full=full,
        stale=stale,
        all_full=all_full,
        none_healthy_retry_after_s=none_healthy_retry_after_s,
    )
