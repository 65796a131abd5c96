"""validate_payload's range checks against the plain rules they encode.

gridd.core.payload reads a count as `0.0 <= value < inf` and a fraction as `0.0 <= value <= 1.0`
(chained comparisons NaN and infinities fail) and the load's fields by name, not getattr. The
reference below is the rule as written first (math.isfinite and a comparison, getattr by
name); on batches with every kind of value both must name the same problem, or none.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest

from gridd.core.batch import Batch
from gridd.core.payload import validate_payload
from gridd.core.readings import (
    BatchOrder,
    LatencyBlock,
    LoadSignals,
    Revision,
    UnitLoad,
    legacy_sample_count,
    sample_count,
)


def bad_count(value: float | None) -> bool:
    return value is not None and not (math.isfinite(value) and value >= 0)


def bad_fraction(value: float | None) -> bool:
    return value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0)


def has_pool_sample(load: LoadSignals) -> bool:
    return any(v is not None for v in (load.avg_running, load.avg_waiting, load.kv_mean, load.in_flight))


def load_problem(load: LoadSignals) -> str | None:
    if load.ready_endpoints is not None and load.ready_endpoints < 0:
        return f"load.ready_endpoints={load.ready_endpoints} is negative"
    if load.queue_full_units < 0:
        return f"load.queue_full_units={load.queue_full_units} is negative"
    for name in ("avg_running", "avg_waiting", "kv_spread", "flow_queue", "in_flight"):
        if bad_count(getattr(load, name)):
            return f"load.{name}={getattr(load, name)!r} is not a finite non-negative number"
    if bad_fraction(load.kv_mean):
        return f"load.kv_mean={load.kv_mean!r} is outside 0..1"
    seen: set[str] = set()
    for i, unit in enumerate(load.units):
        if not unit.unit:
            return f"load.units[{i}] has an empty name"
        if unit.unit in seen:
            return f"load.units[{i}] repeats unit {unit.unit!r}"
        seen.add(unit.unit)
        if bad_count(unit.running) or bad_count(unit.waiting) or bad_count(unit.in_flight):
            return f"load.units[{i}] running/waiting/in_flight is not a finite non-negative number"
        if bad_fraction(unit.kv_usage):
            return f"load.units[{i}].kv_usage={unit.kv_usage!r} is outside 0..1"
    return None


def latency_problem(latency: LatencyBlock) -> str | None:
    if not (math.isfinite(latency.window_s) and latency.window_s > 0):
        return f"latency.window_s={latency.window_s!r} is not a finite positive number"
    if latency.completed < 0:
        return f"latency.completed={latency.completed} is negative"
    for name in ("ttft_p50_s", "ttft_p90_s", "tpot_s"):
        if bad_count(getattr(latency, name)):
            return f"latency.{name}={getattr(latency, name)!r} is not a finite non-negative number"
    if bad_fraction(latency.error_ratio):
        return f"latency.error_ratio={latency.error_ratio!r} is outside 0..1"
    p50, p90 = latency.ttft_p50_s, latency.ttft_p90_s
    if p50 is not None and p90 is not None and p50 > p90:
        return f"latency.ttft_p50_s={p50} exceeds ttft_p90_s={p90}"
    return None


def reference(batch: Batch) -> str | None:
    """validate_payload's rules, as first written (the ordering and probe rules are shared)."""
    if not batch.model:
        return "empty model"
    if batch.published_ms < 0:
        return f"published_ms={batch.published_ms} is negative"
    if bad_count(batch.age_s):
        return f"age_s={batch.age_s!r} is not a finite non-negative number"
    revision, load = batch.revision, batch.load
    if revision is not None and batch.order is not None:
        return "order beside revision metadata"
    if revision is not None:
        if not revision.provider_uid:
            return "revision.provider_uid is empty"
        if revision.generation < 0:
            return f"revision.generation={revision.generation} is negative"
        if revision.batch_samples < 0:
            return f"revision.batch_samples={revision.batch_samples} is negative"
    if batch.complete:
        if revision is None:
            return "complete batch without revision metadata"
        if load is None:
            return "complete batch without load"
    if load is not None:
        problem = load_problem(load)
        if problem is not None:
            return problem
        if revision is not None:
            pool = 1 if has_pool_sample(load) else 0
            carried = len(load.units) if load.units else pool
            if batch.complete and revision.batch_samples not in (carried, len(load.units) + pool):
                return f"complete batch carries {carried} samples, revision says {revision.batch_samples}"
            if carried > revision.batch_samples:
                return f"batch carries {carried} samples, revision says {revision.batch_samples}"
    if batch.latency is not None:
        problem = latency_problem(batch.latency)
        if problem is not None:
            return problem
    for name, value in batch.probes.items():
        if not name:
            return "probe metadata with an empty name"
        if not math.isfinite(value):
            return f"probe {name!r}={value!r} is not finite"
    for name, age in batch.probe_age_s.items():
        if not (math.isfinite(age) and age >= 0):
            return f"probe {name!r} age {age!r} is not a finite age >= 0"
    return None


# Values a field may hold: good ones, and the edges of each rule.
EDGES = [math.nan, math.inf, -math.inf, -1.0, -0.0, 1.5, 87.5, 1e308, -5e-324, 5e-324, -2, 0, 3]
GOOD = [None, None, 0.0, 0.25, 1.0, 3.0, 12.5]


class Draw:
    """Random batches whose fields are each good but for a few per batch (1 in ``odd``), so
    every rule down validate_payload's list is reached, not only the first ones."""

    def __init__(self, seed: int, odd: int) -> None:
        self.rng = random.Random(seed)
        self.odd = odd

    def pick(self, good: list[Any], edges: list[Any]) -> Any:
        return self.rng.choice(edges if self.rng.randrange(self.odd) == 0 else good)

    def count(self) -> Any:  # a float or None
        return self.pick(GOOD, EDGES)

    def fraction(self) -> Any:  # a float or None
        return self.pick([None, 0.0, 0.5, 1.0], EDGES)

    def load(self) -> LoadSignals:
        units = tuple(UnitLoad(self.pick(["a", "b", "c", "d"], ["", "a"]), running=self.count(),
                               waiting=self.count(), kv_usage=self.fraction(), in_flight=self.count())
                      for _ in range(self.rng.randrange(5)))
        return LoadSignals(ready_endpoints=self.pick([None, 0, 3], [-1]), units=units,
                           avg_running=self.count(), avg_waiting=self.count(), kv_mean=self.fraction(),
                           kv_spread=self.count(), flow_queue=self.pick([0.0, 2.0], EDGES),
                           in_flight=self.count(), queue_full_units=self.pick([0, 2], [-1]))

    def batch(self) -> Batch:
        load = self.load() if self.rng.randrange(4) else None
        samples = [sample_count(load), legacy_sample_count(load)] if load else [0]
        revision = None
        if self.rng.randrange(4):
            revision = Revision(self.pick(["u"], [""]), self.pick([1], [-1]), 1, 1,
                                self.pick(samples, [-1, 0, 1, 2, 3, 4, 5, 6]))
        latency = None
        if self.rng.randrange(2):
            latency = LatencyBlock(window_s=self.pick([5.0], [0.0, *EDGES]),
                                   completed=self.pick([20], [-1, 0]), ttft_p50_s=self.count(),
                                   ttft_p90_s=self.count(), tpot_s=self.count(), error_ratio=self.fraction())
        return Batch(site="s", provider="p", model=self.pick(["m"], [""]), published_ms=self.pick([5], [-1]),
                     age_s=self.pick([0.0, 1.5], EDGES), revision=revision,
                     complete=self.pick([revision is not None], [True, False]), load=load, latency=latency,
                     order=self.pick([None if revision else BatchOrder(1, 1)], [BatchOrder(1, 1)]),
                     probes=self.pick([{}, {"x.a": 1.0}], [{"": 1.0}, {"x.a": math.nan}]),
                     probe_age_s=self.pick([{}, {"x.a": 0.5}], [{"x.a": -1.0}, {"x.a": math.inf}]))


@pytest.mark.parametrize("odd", [4, 12, 40])
def test_validate_payload_names_the_problem_the_plain_rules_name(odd: int) -> None:
    draw = Draw(odd, odd)
    found: set[str] = set()
    for _ in range(20_000):
        batch = draw.batch()
        problem = reference(batch)
        assert validate_payload(batch) == problem, batch
        found.add(re.sub(r"[=\[ ].*", "", problem or "None"))
    # Every rule was reached (each problem's first word), and batches with none.
    assert len(found) >= 20, found


def test_a_reading_from_a_derivation_is_valid_both_ways() -> None:
    load = LoadSignals(ready_endpoints=2, units=(UnitLoad("a", waiting=1.0, in_flight=2.0),
                                                 UnitLoad("b", waiting=0.0, in_flight=-0.0)),
                       avg_running=1.0, avg_waiting=0.5, kv_mean=0.5, kv_spread=0.1, in_flight=3.0)
    batch = Batch(site="s", provider="p", model="m", published_ms=1, age_s=0.0,
                  revision=Revision("u", 1, 1, 1, sample_count(load)), complete=True, load=load,
                  latency=LatencyBlock(window_s=5.0, completed=20, ttft_p50_s=0.1, ttft_p90_s=0.2))
    assert validate_payload(batch) is None and reference(batch) is None
