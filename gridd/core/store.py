"""The gateway's store: where poll and route meet, and only there (spec: The Poll Path).

ingest():   batches from the local operator pass admission (epoch/sequence fences, skew
            bound), land per (site, provider), feed that candidate's capacity learner,
            and the per-model snapshots are rebuilt and swapped in whole.
decide():   the request path: one snapshot read, one pick, the shedding state. It never
            reads raw signals or computes load.

Pure: ``now`` (monotonic seconds), ``now_wall`` and the random source are passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.capacity import CapacityLearner
from gridd.core.decisions import Decision, Forward, Shed, Unavailable, UnknownModel
from gridd.core.ordering import CandidateView, OrderedSnapshot, build_snapshot, candidate_view
from gridd.core.readings import LoadSignals
from gridd.core.selection import Full, NoCandidates, NoneHealthy, Route, pick
from gridd.core.shedding import ShedState
from gridd.wire import Batch, ServingConfig

LOCAL_RECHECK_S = 2.0
"""A local exclusion can lift at the next scrape + poll (about 2 s at the defaults)."""
REMOTE_RECHECK_S = 6.0
"""A remote one waits on the operator's peer poll (5 s) + the gateway poll (1 s)."""
FORGET_AFTER_TTLS = 2.0
"""A candidate the operator stopped relaying is forgotten once its reading is this many TTLs old."""


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
    def __init__(
        self,
        *,
        site: str,
        signal_ttl_s: float = 20.0,
        future_epoch_bound_s: float = 600.0,
        capacity_floor: float = 1.0,
        rho_smoothing: float = 0.5,
        recent_window_s: float = 30.0,
        shedding: bool = False,
        full_after_s: float = 2.0,
        room_after_s: float = 5.0,
    ) -> None:
        self.site = site
        self.signal_ttl_s = signal_ttl_s
        self.fences = AdmissionFences(future_epoch_bound_s=future_epoch_bound_s)
        self._learner_args = {"floor": capacity_floor, "alpha": rho_smoothing, "recent_window_s": recent_window_s}
        self.shedding_enabled = shedding
        self._shed_args = (full_after_s, room_after_s)
        self.candidates: dict[tuple[str, str], Candidate] = {}
        self.shed: dict[str, ShedState] = {}
        self.snapshots: dict[str, OrderedSnapshot] = {}
        self.local_snapshots: dict[str, OrderedSnapshot] = {}
        self.serving = ServingConfig()
        self.ingests = 0
        self.last_ingest_at: float | None = None

    def reconfigure(self, *, signal_ttl_s: float, future_epoch_bound_s: float, capacity_floor: float,
                    rho_smoothing: float, recent_window_s: float, shedding: bool, full_after_s: float,
                    room_after_s: float) -> None:
        """A committed reload: new knobs, same state. Learned bounds, rho history, fences
        and shedding runs are never rebuilt (DESIGN 4)."""
        self.signal_ttl_s = signal_ttl_s
        self.fences.future_epoch_bound_s = future_epoch_bound_s
        self._learner_args = {"floor": capacity_floor, "alpha": rho_smoothing, "recent_window_s": recent_window_s}
        for cand in self.candidates.values():
            cand.learner.retune(**self._learner_args)
        self.shedding_enabled = shedding
        self._shed_args = (full_after_s, room_after_s)
        for shed in self.shed.values():
            shed.retune(full_after_s=full_after_s, room_after_s=room_after_s)

    # -- poll side ------------------------------------------------------------------------------

    def set_serving(self, serving: ServingConfig) -> None:
        self.serving = serving

    def ingest(self, batches: Iterable[Batch], *, now: float, now_wall: float, complete_view: bool = True) -> None:
        """One poll's answer. ``complete_view``: the answer names every provider the operator
        holds, so a candidate it no longer holds (deleted, or a peer's reading past its TTL)
        is forgotten here too."""
        seen: set[tuple[str, str]] = set()
        for batch in batches:
            key = (batch.site, batch.provider)
            seen.add(key)
            # The local operator relays every site's batches; it verified each peer's
            # identity, so no site attribution check here (verified_site=None).
            admission = self.fences.admit(batch, now_wall=now_wall, verified_site=None)
            if admission.outcome is not Outcome.ACCEPTED:
                continue  # REPEAT leaves age and learning lifetime unchanged; drops are counted
            cand = self.candidates.get(key)
            if cand is None:
                cand = self.candidates[key] = Candidate(batch.site, batch.provider,
                                                        CapacityLearner(**self._learner_args))
            cand.model, cand.batch, cand.received_at = batch.model, batch, now
            if batch.load is not None and batch.load.units:
                cand.units_seen = True
            if batch.load is not None:
                cand.learner.observe(now, batch.revision, batch.load, complete=batch.complete, new_sample=True)
        if complete_view:
            # The operator no longer holds it (deleted, or a peer's reading it expired). One
            # answer is not proof: a restarted operator relays its peers' readings only after
            # its first peer polls. So a missing candidate is kept, ageing (stale, sorted
            # last), and forgotten once its reading is past FORGET_AFTER_TTLS x the TTL.
            horizon = FORGET_AFTER_TTLS * self.signal_ttl_s
            for key in [k for k, c in self.candidates.items() if k not in seen and c.age_s(now) > horizon]:
                del self.candidates[key]
                self.fences.forget(*key)
        self.ingests += 1
        self.last_ingest_at = now
        self.rebuild(now)

    def rebuild(self, now: float) -> None:
        """The scorer: one immutable ordered snapshot per model, swapped in whole."""
        views: dict[str, list[CandidateView]] = {}
        local_providers = {p.provider for p in self.serving.providers}
        ingresses = {i.site for i in self.serving.ingresses}
        for cand in self.candidates.values():
            batch = cand.batch
            if batch is None:
                continue
            local = cand.site == self.site
            # A candidate this gateway cannot forward to (no local endpoint, no ingress for
            # its site) is kept as excluded: the model exists but cannot be served from here.
            routable = cand.provider in local_providers if local else cand.site in ingresses
            fresh = cand.age_s(now) <= self.signal_ttl_s
            load: LoadSignals | None = batch.load if fresh else None
            views.setdefault(cand.model, []).append(candidate_view(
                site=cand.site, provider=cand.provider, model=cand.model, learner=cand.learner, load=load,
                now=now, healthy=routable and excluded_reason(batch, units_seen=cand.units_seen) is None,
                local=local, fresh=fresh,
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
                shed = self.shed[model] = ShedState(*self._shed_args)
            snap = snapshots[model]
            shed.observe(now, all_healthy_saturated=snap.all_full, any_sample_saturated=snap.any_full)
        for model in [m for m in self.shed if m not in views]:
            del self.shed[model]
        self.snapshots, self.local_snapshots = snapshots, local_snapshots

    # -- request side ---------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(self.snapshots)

    def decide(self, model: str, *, now: float, rng: random.Random, pinned_site: str | None = None,
               exclude: frozenset[tuple[str, str]] = frozenset()) -> Decision:
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
        if (self.shedding_enabled and snapshot.ordered and shed is not None and shed.shedding(now)):
            return Shed(shed.retry_after_s(now))
        outcome = pick(snapshot, rng)
        if isinstance(outcome, Full):
            outcome = outcome.route  # shedding off, or not yet full for full_after_ms: route
        if isinstance(outcome, Route):
            return self._forward(outcome)
        if isinstance(outcome, NoneHealthy):
            return Unavailable(outcome.retry_after_s)
        assert isinstance(outcome, NoCandidates)
        return UnknownModel() if not snapshot.excluded else Unavailable(snapshot.none_healthy_retry_after_s)

    def _forward(self, route: Route) -> Forward:
        if route.site == self.site:
            local = next(p for p in self.serving.providers if p.provider == route.provider)
            return Forward(route.site, route.provider, route.model, local=local)
        ingress = next(i.url for i in self.serving.ingresses if i.site == route.site)
        return Forward(route.site, route.provider, route.model, ingress_url=ingress)

    def fresh(self, now: float) -> bool:
        """Holding a snapshot built from a poll within the signal TTL (GET /readyz)."""
        return self.last_ingest_at is not None and now - self.last_ingest_at <= self.signal_ttl_s
