"""The scorer: the held candidates into one immutable ordered snapshot per model.

It runs off the request path, after each ingest and after each failed poll (readings keep
ageing while the operator is unreachable, so stale sites must sort last). Each run builds
every model's snapshots from the candidates' states (gridd.core.candidates), swaps them in
whole, and feeds each model's shedding timers whether all of its fresh healthy sites are
full. The request path (gridd.core.decider) only reads what the last run built.

Pure: ``now`` (monotonic seconds) is passed in.
"""

from __future__ import annotations

from gridd.core.candidates import CandidateTable
from gridd.core.knobs import RoutingKnobs
from gridd.core.ordering import CandidateView, OrderedSnapshot, build_snapshot, candidate_view
from gridd.core.readings import LoadSignals
from gridd.core.shedding import ShedState

__all__ = ["LOCAL_RECHECK_S", "REMOTE_RECHECK_S", "Scorer"]

LOCAL_RECHECK_S = 2.0
"""A local exclusion can lift at the next scrape + poll (about 2 s at the defaults)."""
REMOTE_RECHECK_S = 6.0
"""A remote one waits on the operator's peer poll (5 s) + the gateway poll (1 s)."""


class Scorer:
    """The latest snapshots (every site's, and this site's own for pinned requests) and the
    shedding state of each model they name."""

    def __init__(self, knobs: RoutingKnobs) -> None:
        self.knobs = knobs
        self.snapshots: dict[str, OrderedSnapshot] = {}
        self.local_snapshots: dict[str, OrderedSnapshot] = {}
        self.shed: dict[str, ShedState] = {}

    def reconfigure(self, knobs: RoutingKnobs) -> None:
        """New knobs, same state: shedding runs are never rebuilt (DESIGN 4)."""
        self.knobs = knobs
        for shed in self.shed.values():
            shed.retune(full_after_s=knobs.full_after_s, room_after_s=knobs.room_after_s)

    def score(self, table: CandidateTable, now: float) -> None:
        """One immutable ordered snapshot per model, swapped in whole."""
        views: dict[str, list[CandidateView]] = {}
        for cand in table.candidates.values():
            batch = cand.batch
            if batch is None:
                continue
            state = table.state(cand, now)
            fresh = state.signal == "fresh"
            load: LoadSignals | None = batch.load if fresh else None
            views.setdefault(cand.model, []).append(candidate_view(
                site=cand.site, provider=cand.provider, model=cand.model, learner=cand.learner, load=load,
                now=now, local=cand.site == table.site, fresh=fresh, healthy=state.excluded is None,
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
            shed.observe(now, all_full=snapshots[model].all_full)
        for model in [m for m in self.shed if m not in views]:
            del self.shed[model]
        self.snapshots, self.local_snapshots = snapshots, local_snapshots
