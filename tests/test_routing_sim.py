"""The routing simulator (benchmarks/routing/) keeps running against the real core.

Its figures live in docs/performance.md; here only that it runs, is deterministic for a seed,
and that gridd's routing on it still tracks capacity (a gross regression, not a benchmark).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "routing"))

from sim import Cell, GriddKnobs, SiteSpec, simulate  # noqa: E402

CELL = Cell(sites=(SiteSpec("a", 4), SiteSpec("b", 2)), load=0.5, duration_s=180.0, warmup_s=30.0, seed=5)


def test_the_simulator_is_deterministic_for_a_seed():
    first = simulate(CELL, "gridd", GriddKnobs({"shedding": True}))
    second = simulate(CELL, "gridd", GriddKnobs({"shedding": True}))
    assert first.waits == second.waits and first.served_by_site == second.served_by_site


def test_gridd_splits_by_capacity_and_every_baseline_runs():
    results = {policy: simulate(CELL, policy, GriddKnobs({"shedding": True}) if policy == "gridd" else None)
               for policy in ("gridd", "static", "wrr", "greedy", "least_busy", "random")}
    for policy, result in results.items():
        assert result.completed > 500, policy
        assert result.shed == result.unavailable == result.not_found == 0, policy
    assert abs(results["gridd"].share("a") - 2 / 3) < 0.05
    assert abs(results["random"].share("a") - 1 / 2) < 0.05
