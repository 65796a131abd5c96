"""Why a gateway routes a model as it does (``gridctl explain MODEL``).

Spec (issue "Operability", item 4): the current ordered snapshot for the model and why:
each candidate's rho, learned bounds and their evidence, signal age, exclusion or shed
reason, and what a pick would do now, with the probability of each candidate.

Everything is read from the store's public state at one instant ``now``; nothing is
decided twice where the store already decides it:

- signal state, age and exclusion: ``CandidateTable.state`` (the one place);
- tier, capacity weight, full, ordered rho: the model's ``OrderedSnapshot``, the very
  one the request path reads;
- pick chances: ``selection.pick_chances`` on that snapshot with the store's pick rule
  and the same pending load ``decide()`` adds (``Decider.pending_rho``), so they are
  the exact probabilities of the next request's pick;
- the capacity's evidence: the learner's unit count and per-unit bounds at ``now``, laid
  out as ``capacity = max(units x min(soft side, hard), floor)``; which term is in force is
  named (a test checks the laid-out value equals ``CapacityLearner.capacity``).

What a request gets follows ``Decider.decide`` step by step, without drawing or
recording a send: no routing data (503 ``no_operator_data``), unknown model (404), shedding
(429), a pick (forward), every candidate excluded (503 ``excluded`` or ``silent``). A test
checks it against ``decide()`` on the same store.

Pure: no trio; ``now`` (the store's monotonic clock) is passed in. Reading a model's
``ShedState`` settles its due transitions, as ``decide()`` and status do.
"""

from __future__ import annotations

import math

import msgspec

from gridd.core.candidates import Candidate
from gridd.core.capacity import SOFT_PROBE, backlogged, queue_depth
from gridd.core.decider import NO_OPERATOR_DATA_RETRY_AFTER_S
from gridd.core.ordering import CandidateView, OrderedSnapshot
from gridd.core.selection import pick_chances
from gridd.core.store import GatewayStore
from gridd.core.strategy import STRATEGY_RECHECK_S, CandidateRank, explain_strategy

TIERS = ("room", "not_full", "full", "stale")
"""A healthy candidate's preference tier (docs/routing.md, "Ordering and selection"):
fresh with rho < 1, fresh without room and not full, fresh and full, no fresh reading."""
CAPACITY_BOUNDS = ("prior", "soft", "hard", "floor")
"""Which term sets a candidate's capacity: the prior (unit_capacity per unit), the soft side
(SOFT_PROBE x the most held with nothing queued), the demonstrated limit, the floor."""
OUTCOMES = ("forward", "shed", "unavailable", "unknown_model")
"""What a request for the model gets now: a pick, 429, 503, 404."""


class CapacityEvidence(msgspec.Struct, frozen=True):
    """capacity = max(units x min(soft_side, hard_per_unit), floor); the floor alone
    while no unit count is known. Per-unit values are requests per serving unit.

    units: serving units of the latest sample that reported them (None: unknown yet).
    unit_capacity: the prior per unit (``routing.unit_capacity``).
    soft_per_unit: the most held per unit with nothing queued, within the evidence window.
    hard_per_unit: the mean demonstrated per-unit limit within the window.
    soft_side: max(unit_capacity, SOFT_PROBE x soft_per_unit).
    bound: which term is in force, one of CAPACITY_BOUNDS.
    """

    units: int | None
    unit_capacity: float
    soft_per_unit: float | None
    hard_per_unit: float | None
    soft_side: float
    floor: float
    bound: str
    capacity: float


class CandidateExplain(msgspec.Struct, frozen=True):
    """One candidate of the model at ``now``.

    signal / age_s / excluded: from ``CandidateTable.state``.
    arrived_age_s: the age the batch carried when it reached this gateway (the operator's
        scrape-to-send time, plus the peer relay for another site); held_s: how long this
        gateway has held it since. age_s = arrived_age_s + held_s.
    tier: one of TIERS; None when excluded.
    weight: the capacity the draws weigh it by (the snapshot's; equals capacity.capacity
        unless evidence aged out since the snapshot was built).
    rho: the smoothed rho after the latest sample; recent_worst_rho: the largest within
        routing.recent_window_s of ``now`` (None: every sample aged out); ordered_rho:
        the recent worst the snapshot ordered it by (None when stale).
    full: saturated (rho >= 1) and backlogged, as ordering read it; backlogged: from the
        latest reading (None without load).
    pending_sends: this gateway's sends to it made after its reading was taken;
        pending_rho: the rho they add to a pick's comparison.
    chance: the probability that the next request's pick takes it.
    strategy: under a strategy, its filter and rank of this candidate (kept with its
        position and sort-key values, dropped with the bound, or excluded by the grid).
    reason: one human line: why it stands where it does.
    """

    site: str
    provider: str
    local: bool
    signal: str
    age_s: float
    arrived_age_s: float | None
    held_s: float | None
    ready: bool | None
    ready_reason: str
    excluded: str | None
    tier: str | None
    weight: float
    capacity: CapacityEvidence
    in_flight: float | None
    rho: float | None
    recent_worst_rho: float | None
    ordered_rho: float | None
    full: bool
    backlogged: bool | None
    queue_depth: float | None
    pending_sends: int
    pending_rho: float
    chance: float
    reason: str
    strategy: CandidateRank | None = None


class ShedExplain(msgspec.Struct, frozen=True):
    """The model's shedding state.

    enabled: ``availability.shedding.enabled``. shedding: the model sheds now (only
    consulted when enabled). run: ``full`` while not shedding and every fresh healthy
    candidate was full at the last ingest (the model sheds once that lasts full_after);
    ``relief`` while shedding and some fresh healthy candidate was not full (it routes
    again once that lasts room_after); None otherwise. next_change_s: the time until the
    state can next change (the 429's Retry-After hint, clamped to [1, 60] s). run_for_s:
    how long the run has lasted.
    """

    enabled: bool
    shedding: bool
    run: str | None
    next_change_s: float | None
    run_for_s: float | None = None


class RequestOutcome(msgspec.Struct, frozen=True):
    """What a request for the model gets now.

    kind: one of OUTCOMES. status: the HTTP status gridd answers itself (None for a
    forward: the upstream's). cause: for ``unavailable`` the 503's cause
    (``no_operator_data``, ``excluded``, ``silent``); for a forward ``full`` when every
    fresh healthy candidate is full (forwarded all the same). retry_after_s: the
    Retry-After hint before jitter. message: one human line.
    """

    kind: str
    status: int | None
    cause: str | None
    retry_after_s: float | None
    message: str


class ModelExplain(msgspec.Struct, frozen=True):
    """``gridctl explain MODEL``: the model's candidates in snapshot order (healthy least
    loaded first, then excluded), what a request gets, and the shedding state."""

    model: str
    pick_rule: str
    pending_weight: float
    signal_ttl_s: float
    outcome: RequestOutcome
    shedding: ShedExplain
    candidates: list[CandidateExplain]
    known_models: list[str]
    strategy: str | None = None


def capacity_evidence(store: GatewayStore, cand: Candidate, now: float) -> CapacityEvidence:
    learner = cand.learner
    soft, hard = learner.unit_bounds(now)
    prior = learner.unit_capacity
    capacity, bound = learner.capacity_and_bound(now)
    return CapacityEvidence(units=learner.units, unit_capacity=prior, soft_per_unit=soft, hard_per_unit=hard,
                            soft_side=prior if soft is None else max(prior, SOFT_PROBE * soft),
                            floor=learner.floor, bound=bound, capacity=capacity)


def _tier(view: CandidateView | None) -> str | None:
    if view is None or not view.healthy:
        return None
    if view.stale:
        return "stale"
    if view.full:
        return "full"
    return "room" if view.rho < 1.0 else "not_full"


def _capacity_reason(ev: CapacityEvidence) -> str:
    if ev.units is None:
        return f"capacity {ev.capacity:g}: the floor (no serving-unit count yet)"
    soft = "none" if ev.soft_per_unit is None else f"{ev.soft_per_unit:.2f}/unit"
    hard = "none" if ev.hard_per_unit is None else f"{ev.hard_per_unit:.2f}/unit"
    in_force = {"prior": f"the prior {ev.unit_capacity:g}/unit",
                "soft": f"the soft side {ev.soft_side:.2f}/unit",
                "hard": f"the limit {hard}", "floor": f"the floor {ev.floor:g}"}[ev.bound]
    return (f"capacity {ev.capacity:.1f} from {in_force} x {ev.units} units "
            f"(held with nothing queued {soft}, demonstrated limit {hard})")


def _standing(c: CandidateExplain) -> str:
    if c.excluded is not None:
        why = {
            "not_ready": f"not ready ({c.ready_reason or 'no reason given'})",
            "zero_ready_endpoints": "0 ready endpoints",
            "unit_series_stopped": "per-unit series stopped while the ready count kept coming",
            "no_route": "this gateway cannot forward there (no local endpoint, or no ingress for the site)",
            "silent": "no reading for 2 x the signal TTL",
        }.get(c.excluded, c.excluded)
        return f"excluded ({c.excluded}): {why}"
    if c.tier == "stale":
        return "stale: no fresh reading; used only when no fresh healthy candidate is left"
    if c.tier == "full":
        return f"full: rho {c.rho:.2f} >= 1 and backlogged"
    rho = "-" if c.ordered_rho is None else f"{c.ordered_rho:.2f}"
    if c.tier == "not_full":
        return f"no room (rho {rho} >= 1) but not full (not backlogged)"
    return f"room (rho {rho} < 1)"


def _candidate(store: GatewayStore, cand: Candidate, view: CandidateView | None, now: float,
               chances: dict[tuple[str, str], float],
               ranks: dict[tuple[str, str], CandidateRank]) -> CandidateExplain:
    state = store.candidate_state(cand, now)
    batch, learner, key = cand.batch, cand.learner, (cand.site, cand.provider)
    load = batch.load if batch is not None else None
    pending = store.sends.since(key, now - state.age_s) if math.isfinite(state.age_s) else 0
    pending_rho = (store.pending_rho(now)(view) if view is not None and store.knobs.pending_weight > 0
                   else 0.0)
    evidence = capacity_evidence(store, cand, now)
    explained = CandidateExplain(
        site=cand.site, provider=cand.provider, local=cand.site == store.site,
        signal=state.signal, age_s=state.age_s,
        arrived_age_s=batch.age_s if batch is not None else None,
        held_s=max(0.0, now - cand.received_at) if batch is not None else None,
        ready=batch.ready if batch is not None else None, ready_reason=batch.ready_reason if batch else "",
        excluded=state.excluded,
        tier=_tier(view),
        weight=view.capacity if view is not None else learner.bound,
        capacity=evidence, in_flight=learner.in_flight, rho=learner.rho,
        recent_worst_rho=learner.recent_worst_rho(now),
        ordered_rho=view.rho if view is not None and math.isfinite(view.rho) else None,
        full=view.full if view is not None else False,
        backlogged=backlogged(load) if load is not None else None,
        queue_depth=queue_depth(load) if load is not None else None,
        pending_sends=pending, pending_rho=pending_rho, chance=chances.get(key, 0.0), reason="",
        strategy=ranks.get(key),
    )
    age = f"reading {state.age_s:.1f} s old"
    if explained.arrived_age_s is not None:
        age += f" (arrived {explained.arrived_age_s:.1f} s old, held here {explained.held_s:.1f} s)"
    parts = [_standing(explained), _capacity_reason(evidence), age]
    if pending:
        parts.append(f"{pending} send(s) since its reading add rho {pending_rho:.2f}")
    rank = ranks.get(key)
    if rank is not None and rank.verdict == "kept":
        parts.append(f"strategy: kept, rank {rank.position}")
    elif rank is not None and rank.verdict == "dropped":
        parts.append(f"strategy: dropped ({rank.reason})")
    return msgspec.structs.replace(explained, reason="; ".join(parts))


def _outcome(store: GatewayStore, model: str, snapshot: OrderedSnapshot | None, now: float,
             chances: dict[tuple[str, str], float], shedding_now: bool) -> RequestOutcome:
    # The steps of Decider.decide, in its order, without a draw.
    problem = store.routing_data_problem(now)
    if problem is not None:
        return RequestOutcome("unavailable", 503, "no_operator_data", NO_OPERATOR_DATA_RETRY_AFTER_S, problem)
    if snapshot is None:
        return RequestOutcome("unknown_model", 404, None, None, f"no site serves {model!r}")
    shed = store.shed.get(model)
    if shedding_now and snapshot.ordered and shed is not None:
        return RequestOutcome("shed", 429, None, shed.retry_after_s(now),
                              "every fresh healthy candidate has been full for full_after: shedding")
    if chances:
        picks = ", ".join(f"{site}/{provider} {p:.1%}"
                          for (site, provider), p in sorted(chances.items(), key=lambda kv: (-kv[1], kv[0])))
        if snapshot.all_full:
            why = "shedding is off" if not store.knobs.shedding else "not yet full for full_after"
            return RequestOutcome("forward", None, "full", None,
                                  f"every fresh healthy candidate is full; forwarded ({why}): {picks}")
        return RequestOutcome("forward", None, None, None, picks)
    if snapshot.excluded:
        cause = store.unavailable_cause(snapshot, now)
        return RequestOutcome("unavailable", 503, cause, snapshot.none_healthy_retry_after_s,
                              f"every candidate is {cause}")
    return RequestOutcome("unknown_model", 404, None, None, f"no site serves {model!r}")


def explain_model(store: GatewayStore, model: str, *, now: float) -> ModelExplain:
    """Explain ``model`` on ``store`` at ``now`` (see the module docstring)."""
    knobs = store.knobs
    snapshot = store.snapshots.get(model)
    chances: dict[tuple[str, str], float] = {}
    ranks: dict[tuple[str, str], CandidateRank] = {}
    strategy = knobs.strategies.for_model(model)
    all_dropped = False
    views: dict[tuple[str, str], CandidateView] = {}
    order: dict[tuple[str, str], int] = {}
    if snapshot is not None:
        for i, view in enumerate((*snapshot.ordered, *snapshot.excluded)):
            views[(view.site, view.provider)] = view
            order[(view.site, view.provider)] = i
        extra_rho = store.pending_rho(now) if knobs.pending_weight > 0 else None
        if strategy is None:
            chances = pick_chances(snapshot, rule=knobs.pick_rule, extra_rho=extra_rho)
        else:
            # The same filter and rank decide() applies (gridd/core/strategy.py).
            ranks = {(r.site, r.provider): r for r in explain_strategy(
                snapshot, strategy, store.probe_values(now), rule=knobs.strategies.pick_rule,
                extra_rho=extra_rho)}
            chances = {key: r.chance for key, r in ranks.items() if r.chance > 0}
            all_dropped = bool(snapshot.ordered) and not any(r.verdict == "kept" for r in ranks.values())
    shed = store.shed.get(model) if knobs.shedding else None  # consulted only when enabled
    shedding_now = shed is not None and shed.shedding(now)
    run, since = None, None
    if shed is not None:
        if shedding_now and shed.relief_since is not None:
            run, since = "relief", shed.relief_since
        elif not shedding_now and shed.full_since is not None:
            run, since = "full", shed.full_since
    shedding = ShedExplain(enabled=knobs.shedding, shedding=shedding_now, run=run,
                           next_change_s=shed.retry_after_s(now) if shed is not None and (run or shedding_now)
                           else None,
                           run_for_s=None if since is None else round(now - since, 3))
    outcome = _outcome(store, model, snapshot, now, chances, shedding_now)
    if strategy is not None and all_dropped and outcome.kind in ("unavailable", "unknown_model") \
            and outcome.cause != "no_operator_data":  # all_dropped only under a strategy
        outcome = RequestOutcome("unavailable", 503, "strategy", STRATEGY_RECHECK_S,
                                 f"every healthy candidate is over strategy {strategy.name!r}'s bounds")
    if outcome.kind != "forward":
        chances = {}  # a request answered 429/503/404 is not picked
    members = sorted((c for c in store.candidates.values() if c.model == model),
                     key=lambda c: (order.get((c.site, c.provider), len(order)), c.site, c.provider))
    return ModelExplain(
        model=model, pick_rule=knobs.pick_rule, pending_weight=knobs.pending_weight,
        signal_ttl_s=knobs.signal_ttl_s, outcome=outcome, shedding=shedding,
        candidates=[_candidate(store, c, views.get((c.site, c.provider)), now, chances, ranks)
                    for c in members],
        known_models=store.models(), strategy=strategy.name if strategy is not None else None,
    )
