"""The candidates a gateway holds, and where each stands (spec: The Poll Path).

``CandidateTable`` is the intake of the local operator's poll answers: each batch passes
admission (epoch/sequence fences, skew bound), lands per (site, provider) and feeds that
candidate's capacity learner; providers the operator announces removed, or that no reading
has come for in ``candidate_retention_s``, are forgotten. It also decides, in one place,
each candidate's signal state and exclusion (``CandidateTable.state``), which the scorer,
the decider, status and explain all read.

A candidate's reading goes through four states as it ages (docs/routing.md, "The store"):
fresh (within the signal TTL), stale (sorts last, used only when no fresh healthy site is
left), silent (past SILENT_AFTER_TTLS x the TTL: excluded, so its model answers 503 with
Retry-After, never 404) and forgotten (past ``candidate_retention_s``, or at once when the
operator announces the provider removed).

Pure: ``now`` (monotonic seconds) and ``now_wall`` are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.batch import Batch
from gridd.core.capacity import CapacityLearner
from gridd.core.knobs import RoutingKnobs
from gridd.core.serving import ServingRoutes

__all__ = [
    "EXCLUSION_REASONS",
    "SIGNAL_STATES",
    "SILENT_AFTER_TTLS",
    "Candidate",
    "CandidateState",
    "CandidateTable",
    "excluded_reason",
]

SILENT_AFTER_TTLS = 2.0
"""A candidate whose reading is this many TTLs old is silent: excluded (503), not routed to
(the operator relays a silent peer's readings this long; see operator/peers.py)."""

EXCLUSION_REASONS = ("not_ready", "zero_ready_endpoints", "unit_series_stopped", "no_route", "silent")
"""Why a candidate is out of selection (gridctl status's EXCLUDED; docs/troubleshooting.md)."""
SIGNAL_STATES = ("fresh", "stale", "silent")
"""How recent a candidate's reading is: within the TTL, past it, past SILENT_AFTER_TTLS x it."""


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


class CandidateTable:
    """Every candidate this gateway holds, keyed by (site, provider), with the admission
    fences its batches pass and the serving routes that decide whether it is routable."""

    def __init__(self, *, site: str, knobs: RoutingKnobs, serving: ServingRoutes) -> None:
        self.site = site
        self.knobs = knobs
        self.fences = AdmissionFences(future_epoch_bound_s=knobs.future_epoch_bound_s)
        self.candidates: dict[tuple[str, str], Candidate] = {}
        self.set_serving(serving)
        self.ingests = 0
        self.last_ingest_at: float | None = None
        """The latest answer that carried routing data (or legitimately none: no providers)."""
        self.last_unusable: tuple[float, dict[str, int]] | None = None
        """(when, drops by reason) of the latest answer whose every batch was dropped."""

    def reconfigure(self, knobs: RoutingKnobs) -> None:
        """New knobs, same state: fences and learned bounds are kept (DESIGN 4)."""
        self.knobs = knobs
        self.fences.future_epoch_bound_s = knobs.future_epoch_bound_s
        for cand in self.candidates.values():
            cand.learner.retune(**knobs.learner_args())

    def set_serving(self, serving: ServingRoutes) -> None:
        self.serving = serving
        self._local_providers = frozenset(p.provider for p in serving.providers)
        self._ingress_sites = frozenset(i.site for i in serving.ingresses)

    def ingest(self, batches: Iterable[Batch], *, now: float, now_wall: float, complete_view: bool = True,
               removed: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """Admit and hold one poll's answer; return the keys it made this table forget.

        ``removed``: providers the operator announces as removed from its site's config (or
        a peer's): forgotten at once, so their model answers 404 within one poll.
        ``complete_view``: the answer names every provider the operator holds; one it no
        longer holds is kept, ageing, until candidate_retention_s."""
        seen: set[tuple[str, str]] = set()
        dropped: dict[str, int] = {}
        forgotten: list[tuple[str, str]] = []
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
                cand.learner.observe(now, batch.revision, batch.load, complete=batch.complete,
                                     new_sample=True)
        for key in removed:
            if key not in seen:
                forgotten.append(self._forget(key))
        if complete_view:
            # The operator no longer holds it (a peer's reading it expired, or an operator
            # restarted and not yet polling its peers). That is not proof the provider is
            # gone: it ages through stale and silent (503), and is forgotten only once no
            # reading has come for candidate_retention_s.
            horizon = self.knobs.candidate_retention_s
            for key in [k for k, c in self.candidates.items() if k not in seen and c.age_s(now) > horizon]:
                forgotten.append(self._forget(key))
        self.ingests += 1
        if seen and sum(dropped.values()) == len(seen):
            # Every batch of the answer was refused (say all as skew: this gateway's clock is
            # far behind its operator's): that is no routing data, not an empty grid. The
            # gateway cannot tell which models exist, so it must not answer 404.
            self.last_unusable = (now, dropped)
        else:
            self.last_ingest_at = now
        return forgotten

    def _forget(self, key: tuple[str, str]) -> tuple[str, str]:
        self.candidates.pop(key, None)
        self.fences.forget(*key)
        return key

    def state(self, cand: Candidate, now: float) -> CandidateState:
        """The candidate's signal state and exclusion at ``now``: the one place both are
        decided (ordering, status and explain all read this)."""
        age = cand.age_s(now)
        ttl = self.knobs.signal_ttl_s
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

    # -- routing data: whether the operator's answers tell this gateway anything -------------

    def has_routing_data(self, now: float) -> bool:
        """Holding a snapshot built from a poll within the signal TTL (GET /readyz, and
        what tells a 404 from "no routing data from the operator")."""
        return self.last_ingest_at is not None and now - self.last_ingest_at <= self.knobs.signal_ttl_s

    def routing_data_problem(self, now: float) -> str | None:
        """Why the gateway has no routing data, or None: the cause a 503 and status name."""
        ttl = self.knobs.signal_ttl_s
        if self.has_routing_data(now):
            return None
        unusable = self.last_unusable
        if unusable is not None and (self.last_ingest_at is None or unusable[0] > self.last_ingest_at):
            drops = ", ".join(f"{reason} {n}" for reason, n in sorted(unusable[1].items()))
            hint = (" (skew: their publisher epochs are more than timings.future_epoch_bound_s ahead of "
                    "this gateway's clock; check both clocks)" if "skew" in unusable[1] else "")
            return ("no usable routing data from the operator: every batch of its answers was dropped "
                    f"({drops}){hint}")
        if self.last_ingest_at is None:
            return "no routing data from the operator: no poll has succeeded yet"
        age = now - self.last_ingest_at
        return (f"no routing data from the operator: the last successful poll was {age:.0f} s ago "
                f"(signal TTL {ttl:g} s)")
