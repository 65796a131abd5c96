"""The gateway's store: where poll and route meet, and only there (spec: The Poll Path).

ingest():   batches from the local operator pass admission (epoch/sequence fences, skew
            bound), land per (site, provider), feed that candidate's capacity learner,
            and the per-model snapshots are rebuilt and swapped in whole.
decide():   the request path: one snapshot read, one pick (raised by this gateway's own
            sends that the readings cannot show yet, gridd.core.pending), the shedding
            state. It never reads raw signals or computes load. A model with a strategy
            (gridd.core.strategy) is picked by it instead, among the same healthy
            candidates, on the probe values of their current batches.

A candidate's reading goes through four states as it ages (docs/routing.md, "The store"):
fresh (within the signal TTL), stale (sorts last, used only when no fresh healthy site is
left), silent (past SILENT_AFTER_TTLS x the TTL: excluded, so its model answers 503 with
Retry-After, never 404) and forgotten (past ``candidate_retention_s``, or at once when the
operator announces the provider removed).

Pure: ``now`` (monotonic seconds), ``now_wall`` and the random source are passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import msgspec

from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.capacity import (
    DEFAULT_ALPHA,
    DEFAULT_EVIDENCE_WINDOW_S,
    DEFAULT_FLOOR,
    DEFAULT_RECENT_WINDOW_S,
    DEFAULT_UNIT_CAPACITY,
    CapacityLearner,
)
from gridd.core.decisions import Decision, Forward, Shed, Unavailable, UnknownModel
from gridd.core.ordering import CandidateView, OrderedSnapshot, build_snapshot, candidate_view
from gridd.core.pending import DEFAULT_PENDING_WEIGHT, RecentSends
from gridd.core.readings import LoadSignals
from gridd.core.selection import ExtraRho, Full, NoCandidates, NoneHealthy, PickRule, Route, pick
from gridd.core.shedding import DEFAULT_FULL_AFTER_MS, DEFAULT_ROOM_AFTER_MS, ShedState
from gridd.core.strategy import AllDropped, StrategyTable, Values, fresh_values, strategy_pick
from gridd.wire import Batch, ServingConfig

LOCAL_RECHECK_S = 2.0
"""A local exclusion can lift at the next scrape + poll (about 2 s at the defaults)."""
REMOTE_RECHECK_S = 6.0
"""A remote one waits on the operator's peer poll (5 s) + the gateway poll (1 s)."""
SILENT_AFTER_TTLS = 2.0
"""A candidate whose reading is this many TTLs old is silent: excluded (503), not routed to
(the operator relays a silent peer's readings this long; see operator/peers.py)."""
NO_OPERATOR_DATA_RETRY_AFTER_S = 2.0
"""Retry-After of a 503 while the gateway has no routing data: the next poll or two."""


class RoutingKnobs(msgspec.Struct, frozen=True, kw_only=True):
    """The gateway store's knobs (config ``routing.*``, ``timings.*``,
    ``availability.shedding.*``; docs/routing.md has each one's meaning and default)."""

    signal_ttl_s: float = 20.0
    future_epoch_bound_s: float = 600.0
    capacity_floor: float = DEFAULT_FLOOR
    rho_smoothing: float = DEFAULT_ALPHA
    recent_window_s: float = DEFAULT_RECENT_WINDOW_S
    unit_capacity: float = DEFAULT_UNIT_CAPACITY
    evidence_window_s: float = DEFAULT_EVIDENCE_WINDOW_S
    pick_rule: PickRule = "two_choices"
    pending_weight: float = DEFAULT_PENDING_WEIGHT
    candidate_retention_s: float = 600.0
    shedding: bool = False
    full_after_s: float = DEFAULT_FULL_AFTER_MS / 1000
    room_after_s: float = DEFAULT_ROOM_AFTER_MS / 1000
    strategies: StrategyTable = StrategyTable()
    """Per model, the strategy that filters and ranks on probe metadata (none by default)."""

    def learner_args(self) -> dict[str, float]:
        return {"floor": self.capacity_floor, "alpha": self.rho_smoothing,
                "recent_window_s": self.recent_window_s, "unit_capacity": self.unit_capacity,
                "evidence_window_s": self.evidence_window_s}


class Candidate:
    __slots__ = ("site", "provider", "model", "batch", "received_at", "learner", "units_seen")

    def __init__(self, site: str, provider: str, learner: CapacityLearner) -> None:
        self.site = site
        self.provider = provider
        self.model = ""
        self.batch: Batch | None = None
        self.received_at = 0.0
        self.learner = learner
        self.units_seen = False
        """Per-unit samples arrived for this candidate before (their stopping excludes it)."""

    def age_s(self, now: float) -> float:
        if self.batch is None:
            return math.inf
        return self.batch.age_s + max(0.0, now - self.received_at)


EXCLUSION_REASONS = ("not_ready", "zero_ready_endpoints", "unit_series_stopped", "no_route", "silent")
"""Why a candidate is out of selection (gridctl status's EXCLUDED; docs/troubleshooting.md)."""
SIGNAL_STATES = ("fresh", "stale", "silent")
"""How recent a candidate's reading is: within the TTL, past it, past SILENT_AFTER_TTLS x it."""


class CandidateState(msgspec.Struct, frozen=True):
    """Where one candidate stands at one instant (what status and explain show).

    signal: one of SIGNAL_STATES. excluded: one of EXCLUSION_REASONS, or None.
    """

    signal: str
    excluded: str | None
    age_s: float


def excluded_reason(batch: Batch, *, units_seen: bool = True) -> str | None:
    """Why a site leaves selection, or None. A reading of ready 0, a zero ready count, or
    per-unit series that stopped while the ready count kept stamping exclude it until a
    later reading says otherwise (spec: Provider Readiness, Failure Behavior). "Stopped"
    needs memory: an EPP that never exposed per-unit series (``units_seen`` False) is not
    excluded for lacking them."""
    if batch.ready is False:
        return "not_ready"
    load = batch.load
    if load is not None and load.ready_endpoints is not None:
        if load.ready_endpoints == 0:
            return "zero_ready_endpoints"
        if not load.units and units_seen:
            return "unit_series_stopped"
    return None


class GatewayStore:
    def __init__(self, *, site: str, knobs: RoutingKnobs | None = None) -> None:
        self.site = site
        self.knobs = knobs = knobs or RoutingKnobs()
        self.fences = AdmissionFences(future_epoch_bound_s=knobs.future_epoch_bound_s)
        self.candidates: dict[tuple[str, str], Candidate] = {}
        self.shed: dict[str, ShedState] = {}
        self.snapshots: dict[str, OrderedSnapshot] = {}
        self.local_snapshots: dict[str, OrderedSnapshot] = {}
        self.sends = RecentSends(horizon_s=knobs.signal_ttl_s)
        self.set_serving(ServingConfig())
        self.ingests = 0
        self.last_ingest_at: float | None = None
        """The latest answer that carried routing data (or legitimately none: no providers)."""
        self.last_unusable: tuple[float, dict[str, int]] | None = None
        """(when, drops by reason) of the latest answer whose every batch was dropped."""

    @property
    def signal_ttl_s(self) -> float:
        return self.knobs.signal_ttl_s

    @property
    def shedding_enabled(self) -> bool:
        return self.knobs.shedding

    def reconfigure(self, knobs: RoutingKnobs) -> None:
        """A committed reload: new knobs, same state. Learned bounds, rho history, fences
        and shedding runs are never rebuilt (DESIGN 4)."""
        self.knobs = knobs
        self.fences.future_epoch_bound_s = knobs.future_epoch_bound_s
        for cand in self.candidates.values():
            cand.learner.retune(**knobs.learner_args())
        for shed in self.shed.values():
            shed.retune(full_after_s=knobs.full_after_s, room_after_s=knobs.room_after_s)
        self.sends.retune(knobs.signal_ttl_s)

    # -- poll side ------------------------------------------------------------------------------

    def set_serving(self, serving: ServingConfig) -> None:
        self.serving = serving
        self._local_providers = frozenset(p.provider for p in serving.providers)
        self._ingress_sites = frozenset(i.site for i in serving.ingresses)

    def ingest(self, batches: Iterable[Batch], *, now: float, now_wall: float, complete_view: bool = True,
               removed: Iterable[tuple[str, str]] = ()) -> None:
        """One poll's answer. ``removed``: providers the operator announces as removed from
        its site's config (or a peer's): forgotten at once, so their model answers 404
        within one poll. ``complete_view``: the answer names every provider the operator
        holds; one it no longer holds is kept, ageing, until candidate_retention_s."""
        seen: set[tuple[str, str]] = set()
        dropped: dict[str, int] = {}
        for batch in batches:
            key = (batch.site, batch.provider)
            seen.add(key)
            # The local operator relays every site's batches; it verified each peer's
            # identity, so no site attribution check here (verified_site=None).
            admission = self.fences.admit(batch, now_wall=now_wall, verified_site=None)
            if admission.outcome is Outcome.DROPPED:
                reason = admission.reason or "dropped"
                dropped[reason] = dropped.get(reason, 0) + 1
            if admission.outcome is not Outcome.ACCEPTED:
                continue  # REPEAT leaves age and learning lifetime unchanged; drops are counted
            cand = self.candidates.get(key)
            if cand is None:
                cand = self.candidates[key] = Candidate(batch.site, batch.provider,
                                                        CapacityLearner(**self.knobs.learner_args()))
            cand.model, cand.batch, cand.received_at = batch.model, batch, now
            if batch.load is not None and batch.load.units:
                cand.units_seen = True
            if batch.load is not None:
                cand.learner.observe(now, batch.revision, batch.load, complete=batch.complete, new_sample=True)
        for key in removed:
            if key not in seen:
                self._forget(key)
        if complete_view:
            # The operator no longer holds it (a peer's reading it expired, or an operator
            # restarted and not yet polling its peers). That is not proof the provider is
            # gone: it ages through stale and silent (503), and is forgotten only once no
            # reading has come for candidate_retention_s.
            horizon = self.knobs.candidate_retention_s
            for key in [k for k, c in self.candidates.items() if k not in seen and c.age_s(now) > horizon]:
                self._forget(key)
        self.ingests += 1
        if seen and sum(dropped.values()) == len(seen):
            # Every batch of the answer was refused (say all as skew: this gateway's clock is
            # far behind its operator's): that is no routing data, not an empty grid. The
            # gateway cannot tell which models exist, so it must not answer 404.
            self.last_unusable = (now, dropped)
        else:
            self.last_ingest_at = now
        self.rebuild(now)

    def _forget(self, key: tuple[str, str]) -> None:
        self.candidates.pop(key, None)
        self.fences.forget(*key)
        self.sends.forget(key)

    def candidate_state(self, cand: Candidate, now: float) -> CandidateState:
        """The candidate's signal state and exclusion at ``now``: the one place both are
        decided (ordering, status and explain all read this)."""
        age = cand.age_s(now)
        ttl = self.signal_ttl_s
        signal = "fresh" if age <= ttl else ("stale" if age <= SILENT_AFTER_TTLS * ttl else "silent")
        if signal == "silent":
            # Whatever its last reading said, it says nothing now: the model answers 503
            # "silent" (and a not-ready reading from long ago is not the reason given).
            return CandidateState(signal, "silent", age)
        excluded = excluded_reason(cand.batch, units_seen=cand.units_seen) if cand.batch is not None else None
        if excluded is None:
            if not self._routable(cand):
                # A candidate this gateway cannot forward to (no local endpoint, no ingress
                # for its site) is kept as excluded: the model exists but cannot be served
                # from here.
                excluded = "no_route"
        return CandidateState(signal, excluded, age)

    def _routable(self, cand: Candidate) -> bool:
        if cand.site == self.site:
            return cand.provider in self._local_providers
        return cand.site in self._ingress_sites

    def rebuild(self, now: float) -> None:
        """The scorer: one immutable ordered snapshot per model, swapped in whole."""
        views: dict[str, list[CandidateView]] = {}
        for cand in self.candidates.values():
            batch = cand.batch
            if batch is None:
                continue
            state = self.candidate_state(cand, now)
            fresh = state.signal == "fresh"
            load: LoadSignals | None = batch.load if fresh else None
            views.setdefault(cand.model, []).append(candidate_view(
                site=cand.site, provider=cand.provider, model=cand.model, learner=cand.learner, load=load,
                now=now, local=cand.site == self.site, fresh=fresh, healthy=state.excluded is None,
            ))
        snapshots: dict[str, OrderedSnapshot] = {}
        local_snapshots: dict[str, OrderedSnapshot] = {}
        for model, model_views in views.items():
            excluded_local = any(not v.healthy and v.local for v in model_views)
            hint = LOCAL_RECHECK_S if excluded_local else REMOTE_RECHECK_S
            snapshots[model] = build_snapshot(model, model_views, none_healthy_retry_after_s=hint)
            local_snapshots[model] = build_snapshot(model, [v for v in model_views if v.local],
                                                    none_healthy_retry_after_s=LOCAL_RECHECK_S)
            shed = self.shed.get(model)
            if shed is None:
                shed = self.shed[model] = ShedState(self.knobs.full_after_s, self.knobs.room_after_s)
            snap = snapshots[model]
            shed.observe(now, all_full=snap.all_full)
        for model in [m for m in self.shed if m not in views]:
            del self.shed[model]
        self.snapshots, self.local_snapshots = snapshots, local_snapshots

    # -- request side ---------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(self.snapshots)

    def decide(self, model: str, *, now: float, rng: random.Random, pinned_site: str | None = None,
               exclude: frozenset[tuple[str, str]] = frozenset()) -> Decision:
        if not self.has_routing_data(now):
            # No answer from the operator yet, or none within the TTL: the gateway cannot
            # tell a model that exists from one that does not. A broken setup must not look
            # like a wrong model name (404).
            return Unavailable(NO_OPERATOR_DATA_RETRY_AFTER_S, cause="no_operator_data")
        pinned = pinned_site is not None
        snapshot = (self.local_snapshots if pinned else self.snapshots).get(model)
        if snapshot is None or (pinned and pinned_site != self.site):
            return UnknownModel()
        if exclude:
            # Only on the bounded retry: rebuild without the candidates already tried.
            snapshot = build_snapshot(model, [v for v in (*snapshot.ordered, *snapshot.excluded)
                                              if (v.site, v.provider) not in exclude],
                                      none_healthy_retry_after_s=snapshot.none_healthy_retry_after_s)
        shed = self.shed.get(model)
        # Shed only a model that has a healthy site: with none, the answer is 503 (spec: "a
        # model with no healthy routable site gets 503"). Pinned requests shed too: the pin
        # header comes from clients as well, and must not be a way around a 429.
        if self.knobs.shedding and snapshot.ordered and shed is not None and shed.shedding(now):
            return Shed(shed.retry_after_s(now))
        extra_rho = self.pending_rho(now) if self.knobs.pending_weight > 0 else None
        strategy = self.knobs.strategies.for_model(model)
        if strategy is None:
            outcome = pick(snapshot, rng, rule=self.knobs.pick_rule, extra_rho=extra_rho)
        else:
            # After the grid's rules (exclusion is in the snapshot, shedding above): the
            # strategy filters and ranks only the healthy candidates (gridd/core/strategy.py).
            outcome = strategy_pick(snapshot, rng, strategy, self.probe_values(now),
                                    rule=self.knobs.strategies.pick_rule, extra_rho=extra_rho)
            if isinstance(outcome, AllDropped):
                return Unavailable(outcome.retry_after_s, cause="strategy")
        if isinstance(outcome, Full):
            outcome = outcome.route  # shedding off, or not yet full for full_after_ms: route
        if isinstance(outcome, Route):
            self.sends.record((outcome.site, outcome.provider), now)
            return self._forward(outcome)
        if isinstance(outcome, NoneHealthy):
            return Unavailable(outcome.retry_after_s, cause=self.unavailable_cause(snapshot, now))
        assert isinstance(outcome, NoCandidates)
        if not snapshot.excluded:
            return UnknownModel()
        return Unavailable(snapshot.none_healthy_retry_after_s, cause=self.unavailable_cause(snapshot, now))

    def pending_rho(self, now: float) -> ExtraRho:
        """The rho each candidate's pending sends add at ``now`` (what pick() and explain use)."""
        weight, candidates, sends = self.knobs.pending_weight, self.candidates, self.sends

        def extra_rho(view: CandidateView) -> float:
            # Sends made after the candidate's reading was taken are not in it yet.
            key = (view.site, view.provider)
            cand = candidates.get(key)
            if cand is None:
                return 0.0
            return weight * sends.since(key, now - cand.age_s(now)) / view.capacity
        return extra_rho

    def unavailable_cause(self, snapshot: OrderedSnapshot, now: float) -> str:
        """"silent" when every excluded candidate is excluded for being silent."""
        for view in snapshot.excluded:
            cand = self.candidates.get((view.site, view.provider))
            if cand is not None and self.candidate_state(cand, now).excluded != "silent":
                return "excluded"
        return "silent"

    def _forward(self, route: Route) -> Forward:
        if route.site == self.site:
            local = next(p for p in self.serving.providers if p.provider == route.provider)
            return Forward(route.site, route.provider, route.model, local=local)
        ingress = next(i.url for i in self.serving.ingresses if i.site == route.site)
        return Forward(route.site, route.provider, route.model, ingress_url=ingress)

    def probe_values(self, now: float) -> Values:
        """Each candidate's probe values fresh at ``now``, read from its latest batch at the
        pick (no cache); a value older than the signal TTL is missing (what strategies and
        explain use)."""
        ttl, candidates = self.signal_ttl_s, self.candidates

        def values(view: CandidateView) -> dict[str, float]:
            cand = candidates.get((view.site, view.provider))
            if cand is None or cand.batch is None:
                return {}
            return fresh_values(cand.batch.probes, cand.batch.probe_age_s, cand.age_s(now), ttl)
        return values

    def has_routing_data(self, now: float) -> bool:
        """Holding a snapshot built from a poll within the signal TTL (GET /readyz, and
        what tells a 404 from "no routing data from the operator")."""
        return self.last_ingest_at is not None and now - self.last_ingest_at <= self.signal_ttl_s


    def routing_data_problem(self, now: float) -> str | None:
        """Why the gateway has no routing data, or None: the cause a 503 and status name."""
        if self.last_ingest_at is not None and now - self.last_ingest_at <= self.signal_ttl_s:
            return None
        if self.last_unusable is not None and (self.last_ingest_at is None or self.last_unusable[0] > self.last_ingest_at):
            drops = ", ".join(f"{reason} {n}" for reason, n in sorted(self.last_unusable[1].items()))
            hint = " (skew: their publisher epochs are more than timings.future_epoch_bound_s ahead of this " \
                   "gateway's clock; check both clocks)" if "skew" in self.last_unusable[1] else ""
            return f"no usable routing data from the operator: every batch of its answers was dropped ({drops}){hint}"
        if self.last_ingest_at is None:
            return "no routing data from the operator: no poll has succeeded yet"
        age = now - self.last_ingest_at
        return (f"no routing data from the operator: the last successful poll was {age:.0f} s ago "
                f"(signal TTL {self.signal_ttl_s:g} s)")
