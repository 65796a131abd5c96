"""The gateway's store: where poll and route meet, and only there (spec: The Poll Path).

It is three parts, each its own step:

- intake (gridd.core.candidates.CandidateTable): each poll's batches pass admission, land
  per (site, provider) and feed that candidate's capacity learner; the table decides each
  candidate's signal state and exclusion;
- the scorer (gridd.core.scorer.Scorer): after each ingest, and after each failed poll, the
  candidates into one immutable ordered snapshot per model, swapped in whole, and each
  model's shedding state;
- the decider (gridd.core.decider.Decider): the request path, one snapshot read and one
  pick; it never reads raw signals or computes load.

``GatewayStore`` wires them together for the gateway service, gridctl status and explain
(gridd.core.explain). Pure: ``now`` (monotonic seconds), ``now_wall`` and the random source
are passed in.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from gridd.core.admission import AdmissionFences
from gridd.core.batch import Batch
from gridd.core.candidates import Candidate, CandidateState, CandidateTable
from gridd.core.decider import Decider
from gridd.core.decisions import Decision
from gridd.core.knobs import RoutingKnobs
from gridd.core.ordering import OrderedSnapshot
from gridd.core.pending import RecentSends
from gridd.core.scorer import Scorer
from gridd.core.selection import ExtraRho
from gridd.core.serving import NO_ROUTES, ServingRoutes
from gridd.core.shedding import ShedState
from gridd.core.strategy import Values

__all__ = ["GatewayStore"]


class GatewayStore:
    def __init__(self, *, site: str, knobs: RoutingKnobs | None = None) -> None:
        self.site = site
        self.knobs = knobs = knobs or RoutingKnobs()
        self.table = CandidateTable(site=site, knobs=knobs, serving=NO_ROUTES)
        self.scorer = Scorer(knobs)
        self.decider = Decider(self.table, self.scorer, knobs)

    def reconfigure(self, knobs: RoutingKnobs) -> None:
        """A committed reload: new knobs, same state. Learned bounds, rho history, fences
        and shedding runs are never rebuilt (DESIGN 4)."""
        self.knobs = knobs
        self.table.reconfigure(knobs)
        self.scorer.reconfigure(knobs)
        self.decider.reconfigure(knobs)

    # -- poll side: intake, then the scorer ---------------------------------------------------

    def set_serving(self, serving: ServingRoutes) -> None:
        self.table.set_serving(serving)

    def ingest(self, batches: Iterable[Batch], *, now: float, now_wall: float, complete_view: bool = True,
               removed: Iterable[tuple[str, str]] = ()) -> None:
        """One poll's answer: intake (CandidateTable.ingest), then the scorer."""
        for key in self.table.ingest(batches, now=now, now_wall=now_wall, complete_view=complete_view,
                                     removed=removed):
            self.decider.sends.forget(key)
        self.rebuild(now)

    def rebuild(self, now: float) -> None:
        """The scorer's step alone (a failed poll: readings keep ageing)."""
        self.scorer.score(self.table, now)

    # -- request side ---------------------------------------------------------------------------

    def decide(self, model: str, *, now: float, rng: random.Random, pinned_site: str | None = None,
               exclude: frozenset[tuple[str, str]] = frozenset()) -> Decision:
        return self.decider.decide(model, now=now, rng=rng, pinned_site=pinned_site, exclude=exclude)

    # -- views: what status and explain read ---------------------------------------------------

    @property
    def candidates(self) -> dict[tuple[str, str], Candidate]:
        return self.table.candidates

    @property
    def fences(self) -> AdmissionFences:
        return self.table.fences

    @property
    def snapshots(self) -> dict[str, OrderedSnapshot]:
        return self.scorer.snapshots

    @property
    def local_snapshots(self) -> dict[str, OrderedSnapshot]:
        return self.scorer.local_snapshots

    @property
    def shed(self) -> dict[str, ShedState]:
        return self.scorer.shed

    @property
    def sends(self) -> RecentSends:
        return self.decider.sends

    @property
    def signal_ttl_s(self) -> float:
        return self.knobs.signal_ttl_s

    @property
    def shedding_enabled(self) -> bool:
        return self.knobs.shedding

    def models(self) -> list[str]:
        return sorted(self.scorer.snapshots)

    def candidate_state(self, cand: Candidate, now: float) -> CandidateState:
        return self.table.state(cand, now)

    def pending_rho(self, now: float) -> ExtraRho:
        return self.decider.pending_rho(now)

    def unavailable_cause(self, snapshot: OrderedSnapshot, now: float) -> str:
        return self.decider.unavailable_cause(snapshot, now)

    def probe_values(self, now: float) -> Values:
        return self.decider.probe_values(now)

    def has_routing_data(self, now: float) -> bool:
        return self.table.has_routing_data(now)

    def routing_data_problem(self, now: float) -> str | None:
        return self.table.routing_data_problem(now)
