"""The knobs a gateway's routing runs by: one frozen struct its parts share, replaced whole
on a committed reload (gridd.core.store.GatewayStore.reconfigure)."""

from __future__ import annotations

import msgspec

from gridd.core.capacity import (
    DEFAULT_ALPHA,
    DEFAULT_EVIDENCE_WINDOW_S,
    DEFAULT_FLOOR,
    DEFAULT_RECENT_WINDOW_S,
    DEFAULT_UNIT_CAPACITY,
)
from gridd.core.pending import DEFAULT_PENDING_WEIGHT
from gridd.core.selection import PickRule
from gridd.core.shedding import DEFAULT_FULL_AFTER_MS, DEFAULT_ROOM_AFTER_MS
from gridd.core.strategy import StrategyTable

__all__ = ["RoutingKnobs"]


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
