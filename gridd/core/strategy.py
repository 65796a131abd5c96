"""Gateway strategies on probe metadata (spec 004, "Publishing & reading values"; docs/strategies.md).

A strategy (``performance_based`` in the spec) filters and ranks one model's candidates on
the probe values relayed in their batches:

- ``provider_selector``: upper bounds, ``{namespace: {name: bound}}``. A candidate whose
  value of ``namespace.name`` exceeds its bound is dropped (lower is better). A candidate
  *without* that value is kept: nothing says it is over.
- ``sort``: keys in order, each ``provider_attribute`` ascending unless ``descending``. A
  candidate without a key's value sorts after every candidate with one, whichever the
  direction ("least preferred, still usable"). Ties fall to the grid's own order.

The grid's rules come first and a strategy never overrides them: only the snapshot's healthy
candidates (``ordered``: not excluded, not silent, routable) are filtered and ranked, so an
excluded candidate is never picked whatever its values; shedding (429) is decided before a
strategy runs; a model with no healthy candidate answers 503 or 404 exactly as without one.
What a strategy adds is one answer: every healthy candidate over a bound, which is a 503
(the model exists, nothing may serve it now), never a pick of a candidate it dropped.

Values are read at each pick from the store's current batches (no cache; the spec rebuilds
the metadata on every route), and a value older than the signal TTL is missing
(:func:`fresh_values`).

Pick rules (decided with the routing simulator's ``probe`` scenario, docs/performance.md):

- ``two_choices`` (default): two distinct kept candidates drawn by capacity, the better by
  the sort keys, then by the grid's (preference tier, rho with pending sends). One kept
  candidate: taken.
- ``strict``: the first in rank (the spec's reading). Every gateway sends every request to
  the current first until its next probe tick: a herd.

Pure: no trio, no I/O; ``rng`` and the values are passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from gridd.core.ordering import CandidateView, OrderedSnapshot, Tier
from gridd.core.selection import (
    ExtraRho,
    NoCandidates,
    NoneHealthy,
    Outcome,
    Route,
    draw_two,
    no_extra,
    pair_chances,
    pick_rank,
)

StrategyPickRule = Literal["two_choices", "strict"]
STRATEGY_PICK_RULES: tuple[StrategyPickRule, ...] = ("two_choices", "strict")
DEFAULT_STRATEGY_PICK_RULE: StrategyPickRule = "two_choices"

STRATEGY_RECHECK_S = 5.0
"""Retry-After of a 503 when every healthy candidate is over a bound: about one probe
interval (values change at the next tick; the spec's examples use 5 s)."""


class Bound(msgspec.Struct, frozen=True):
    """``attribute`` above ``limit`` drops the candidate."""

    attribute: str
    limit: float


class SortKey(msgspec.Struct, frozen=True):
    attribute: str
    descending: bool = False


class Strategy(msgspec.Struct, frozen=True):
    name: str
    bounds: tuple[Bound, ...] = ()
    sort: tuple[SortKey, ...] = ()

    @classmethod
    def of(cls, name: str, provider_selector: Mapping[str, Mapping[str, float]],
           sort: Sequence[tuple[str, bool]]) -> Strategy:
        """From config: ``provider_selector`` ``{namespace: {name: bound}}``, ``sort``
        ``[(provider_attribute, descending)]``."""
        bounds = tuple(Bound(f"{namespace}.{key}", float(limit))
                       for namespace, limits in provider_selector.items() for key, limit in limits.items())
        return cls(name, bounds, tuple(SortKey(attribute, descending) for attribute, descending in sort))


class StrategyTable(msgspec.Struct, frozen=True):
    """Which strategy a model routes by: its own entry in ``by_model``, else ``default``;
    None means no strategy (the grid's load-based pick alone)."""

    default: Strategy | None = None
    by_model: dict[str, Strategy] = {}
    pick_rule: StrategyPickRule = DEFAULT_STRATEGY_PICK_RULE

    def for_model(self, model: str) -> Strategy | None:
        return self.by_model.get(model, self.default)


class AllDropped(msgspec.Struct, frozen=True):
    """Every healthy candidate is over a bound of the strategy: 503 with Retry-After."""

    retry_after_s: float
    dropped: int


class CandidateRank(msgspec.Struct, frozen=True):
    """One candidate under a strategy (what ``gridctl explain`` shows).

    verdict: ``kept``, ``dropped`` (over a bound) or ``excluded`` (by the grid: never
        filtered or ranked). reason: for dropped, ``attribute=value > bound``; for
        excluded, "excluded by the grid". keys: the sort keys' values, None where missing.
    position: 1-based rank among the kept. chance: the exact probability of the pick.
    """

    site: str
    provider: str
    verdict: str
    reason: str = ""
    keys: tuple[float | None, ...] = ()
    position: int | None = None
    chance: float = 0.0


Values = Callable[[CandidateView], Mapping[str, float]]
"""A candidate's probe values fresh at this pick (see :func:`fresh_values`)."""


def fresh_values(probes: Mapping[str, float], probe_age_s: Mapping[str, float], batch_age_s: float,
                 ttl_s: float) -> dict[str, float]:
    """The values of one batch that are still fresh: a value's age is the batch's age plus
    how much older than the batch's sample it was (wire: Batch.probe_age_s); one older than
    the signal TTL counts as missing (a failing probe keeps republishing its last values)."""
    return {key: value for key, value in probes.items()
            if batch_age_s + probe_age_s.get(key, 0.0) <= ttl_s and math.isfinite(value)}


def _over(strategy: Strategy, values: Mapping[str, float]) -> str | None:
    for bound in strategy.bounds:
        value = values.get(bound.attribute)
        # A missing value is not evidence of being over: kept (docs/strategies.md).
        if value is not None and value > bound.limit:
            return f"{bound.attribute}={value:g} > {bound.limit:g}"
    return None


def _keys(strategy: Strategy, values: Mapping[str, float]) -> tuple[float | None, ...]:
    return tuple(values.get(key.attribute) for key in strategy.sort)


def _sort_key(strategy: Strategy, keys: tuple[float | None, ...]) -> tuple[tuple[int, float], ...]:
    # Missing sorts after every present value, whichever the direction.
    return tuple((1, 0.0) if v is None else (0, -v if k.descending else v)
                 for k, v in zip(strategy.sort, keys, strict=True))


class _Ranked(msgspec.Struct, frozen=True):
    kept: tuple[CandidateView, ...]
    """In rank order."""
    sort_keys: dict[tuple[str, str], tuple[tuple[int, float], ...]]
    keys: dict[tuple[str, str], tuple[float | None, ...]]
    dropped: dict[tuple[str, str], str]


def _rank_candidates(snapshot: OrderedSnapshot, strategy: Strategy, values: Values) -> _Ranked:
    kept: list[tuple[tuple[tuple[int, float], ...], int, CandidateView]] = []
    sort_keys: dict[tuple[str, str], tuple[tuple[int, float], ...]] = {}
    keys: dict[tuple[str, str], tuple[float | None, ...]] = {}
    dropped: dict[tuple[str, str], str] = {}
    # snapshot.ordered: the grid's healthy candidates only, least loaded first; an excluded
    # candidate is never even looked at.
    for index, view in enumerate(snapshot.ordered):
        ident = (view.site, view.provider)
        vals = values(view)
        keys[ident] = _keys(strategy, vals)
        over = _over(strategy, vals)
        if over is not None:
            dropped[ident] = over
            continue
        sort_keys[ident] = _sort_key(strategy, keys[ident])
        kept.append((sort_keys[ident], index, view))
    kept.sort(key=lambda item: (item[0], item[1]))
    return _Ranked(tuple(view for _, _, view in kept), sort_keys, keys, dropped)


def _winner(ranked: _Ranked, extra_rho: ExtraRho) -> Callable[[CandidateView, CandidateView], CandidateView]:
    def better(first: CandidateView, second: CandidateView) -> CandidateView:
        a = (ranked.sort_keys[(first.site, first.provider)], pick_rank(first, extra_rho))
        b = (ranked.sort_keys[(second.site, second.provider)], pick_rank(second, extra_rho))
        return second if b < a else first
    return better



def strategy_pick(snapshot: OrderedSnapshot, rng: random.Random, strategy: Strategy, values: Values, *,
                  rule: StrategyPickRule = DEFAULT_STRATEGY_PICK_RULE,
                  extra_rho: ExtraRho | None = None) -> Outcome | AllDropped:
    """One request's pick under ``strategy``. Route (via ``strategy``), AllDropped (503),
    or the grid's own NoneHealthy (503) / NoCandidates (404) when no candidate is healthy."""
    if not snapshot.ordered:
        if snapshot.excluded:
            return NoneHealthy(snapshot.none_healthy_retry_after_s, len(snapshot.excluded))
        return NoCandidates()
    ranked = _rank_candidates(snapshot, strategy, values)
    kept = ranked.kept
    if not kept:
        return AllDropped(STRATEGY_RECHECK_S, len(ranked.dropped))
    if rule == "strict" or len(kept) == 1:
        chosen = kept[0]
    else:
        chosen = _winner(ranked, extra_rho or no_extra)(*draw_two(Tier.of(kept), rng))
    return Route(chosen.site, chosen.provider, chosen.model, chosen.local, "strategy")


def explain_strategy(snapshot: OrderedSnapshot, strategy: Strategy, values: Values, *,
                     rule: StrategyPickRule = DEFAULT_STRATEGY_PICK_RULE,
                     extra_rho: ExtraRho | None = None) -> list[CandidateRank]:
    """Per candidate of the snapshot: kept (rank position, sort-key values, exact pick
    chance of :func:`strategy_pick` with the same values and pending load), dropped (which
    bound), or excluded by the grid. Kept first in rank order, then dropped, then excluded.
    For ``gridctl explain``."""
    ranked = _rank_candidates(snapshot, strategy, values)
    kept = ranked.kept
    chances: dict[tuple[str, str], float] = {}
    if len(kept) == 1 or (kept and rule == "strict"):
        chances[(kept[0].site, kept[0].provider)] = 1.0
    elif kept:
        tier = Tier.of(kept)
        for k, p in pair_chances(tier, _winner(ranked, extra_rho or no_extra)).items():
            chances[(kept[k].site, kept[k].provider)] = p
    out = [CandidateRank(v.site, v.provider, "kept", keys=ranked.keys[(v.site, v.provider)], position=i + 1,
                         chance=chances.get((v.site, v.provider), 0.0)) for i, v in enumerate(kept)]
    out += [CandidateRank(v.site, v.provider, "dropped", reason=ranked.dropped[(v.site, v.provider)],
                          keys=ranked.keys[(v.site, v.provider)])
            for v in snapshot.ordered if (v.site, v.provider) in ranked.dropped]
    out += [CandidateRank(v.site, v.provider, "excluded", reason="excluded by the grid")
            for v in snapshot.excluded]
    return out
