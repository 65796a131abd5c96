"""The request path: one decision per request from the scorer's latest snapshots.

``Decider.decide`` reads one snapshot, applies shedding, and picks (raised by this gateway's
own sends that the readings cannot show yet, gridd.core.pending); a model with a strategy
(gridd.core.strategy) is picked by it instead, among the same healthy candidates, on the
probe values of their current batches. It never reads raw signals or computes load. The
pick becomes a ``Forward`` by the serving routes (gridd.core.decisions).

Pure: ``now`` (monotonic seconds) and the random source are passed in.
"""

from __future__ import annotations

import random

from gridd.core.candidates import CandidateTable
from gridd.core.decisions import Decision, Forward, Shed, Unavailable, UnknownModel
from gridd.core.knobs import RoutingKnobs
from gridd.core.ordering import CandidateView, OrderedSnapshot, build_snapshot
from gridd.core.pending import RecentSends
from gridd.core.scorer import Scorer
from gridd.core.selection import ExtraRho, Full, NoCandidates, NoneHealthy, Outcome, Route, pick
from gridd.core.strategy import AllDropped, Values, fresh_values, strategy_pick

__all__ = ["NO_OPERATOR_DATA_RETRY_AFTER_S", "Decider"]

NO_OPERATOR_DATA_RETRY_AFTER_S = 2.0
"""Retry-After of a 503 while the gateway has no routing data: the next poll or two."""


class Decider:
    """Decides requests over one candidate table and its scorer; remembers its own sends."""

    def __init__(self, table: CandidateTable, scorer: Scorer, knobs: RoutingKnobs) -> None:
        self.table = table
        self.scorer = scorer
        self.knobs = knobs
        self.sends = RecentSends(horizon_s=knobs.signal_ttl_s)

    def reconfigure(self, knobs: RoutingKnobs) -> None:
        self.knobs = knobs
        self.sends.retune(knobs.signal_ttl_s)

    def decide(self, model: str, *, now: float, rng: random.Random, pinned_site: str | None = None,
               exclude: frozenset[tuple[str, str]] = frozenset()) -> Decision:
        table = self.table
        if not table.has_routing_data(now):
            # No answer from the operator yet, or none within the TTL: the gateway cannot
            # tell a model that exists from one that does not. A broken setup must not look
            # like a wrong model name (404).
            return Unavailable(NO_OPERATOR_DATA_RETRY_AFTER_S, cause="no_operator_data")
        pinned = pinned_site is not None
        snapshot = (self.scorer.local_snapshots if pinned else self.scorer.snapshots).get(model)
        if snapshot is None or (pinned and pinned_site != table.site):
            return UnknownModel()
        if exclude:
            # Only on the bounded retry: rebuild without the candidates already tried.
            snapshot = build_snapshot(model, [v for v in (*snapshot.ordered, *snapshot.excluded)
                                              if (v.site, v.provider) not in exclude],
                                      none_healthy_retry_after_s=snapshot.none_healthy_retry_after_s)
        shed = self.scorer.shed.get(model)
        # Shed only a model that has a healthy site: with none, the answer is 503 (spec: "a
        # model with no healthy routable site gets 503"). Pinned requests shed too: the pin
        # header comes from clients as well, and must not be a way around a 429.
        if self.knobs.shedding and snapshot.ordered and shed is not None and shed.shedding(now):
            return Shed(shed.retry_after_s(now))
        extra_rho = self.pending_rho(now) if self.knobs.pending_weight > 0 else None
        strategy = self.knobs.strategies.for_model(model)
        outcome: Outcome | AllDropped
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
        weight, candidates, sends = self.knobs.pending_weight, self.table.candidates, self.sends

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
            cand = self.table.candidates.get((view.site, view.provider))
            if cand is not None and self.table.state(cand, now).excluded != "silent":
                return "excluded"
        return "silent"

    def _forward(self, route: Route) -> Forward:
        serving = self.table.serving
        if route.site == self.table.site:
            local = next(p for p in serving.providers if p.provider == route.provider)
            return Forward(route.site, route.provider, route.model, local=local)
        ingress = next(i.url for i in serving.ingresses if i.site == route.site)
        return Forward(route.site, route.provider, route.model, ingress_url=ingress)

    def probe_values(self, now: float) -> Values:
        """Each candidate's probe values fresh at ``now``, read from its latest batch at the
        pick (no cache); a value older than the signal TTL is missing (what strategies and
        explain use)."""
        ttl, candidates = self.knobs.signal_ttl_s, self.table.candidates

        def values(view: CandidateView) -> dict[str, float]:
            cand = candidates.get((view.site, view.provider))
            if cand is None or cand.batch is None:
                return {}
            return fresh_values(cand.batch.probes, cand.batch.probe_age_s, cand.age_s(now), ttl)
        return values
