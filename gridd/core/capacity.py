"""Capacity learning and saturation (rho) for one routing candidate (site, provider).

The gateway never counts its own requests (spec: Site Selection). It reads each
candidate's load from the batches its operator relays and learns, per candidate, a soft
bound "from the most in-flight held with nothing queued" and a hard bound "from the least
held at a demonstrated limit", and reads the in-flight count "against the lesser bound,
never below the floor". What counts as evidence (docs/routing.md, "Capacity learning",
has the measurements behind each choice):

- Evidence is kept **per serving unit** (in-flight / units), so a pool that scales from 4
  to 8 endpoints doubles its capacity at its next batch, and it **ages**: a sample counts
  for ``evidence_window_s`` (60 s), never as an all-time extreme.
- **Before any evidence**, a unit is assumed to hold ``unit_capacity`` requests (the
  prior), so a site's size counts from its first batch: capacity is proportional to the
  serving units the batch reports (ready endpoints, or engines for plain vLLM).
- **Soft evidence** (nothing queued at x requests per unit) says a unit holds at least x.
  Being at the soft bound is not "no room": nothing waited there. So the estimate probes
  above it: the soft side of the bound is ``max(prior, SOFT_PROBE x soft)``.
- **A demonstrated limit** is the provider's limit, not one request waiting behind a long
  one at one endpoint while the others idle. A serving unit only queues once its own
  batch is full, so a unit with work waiting demonstrates *its* limit: the requests it is
  running. That count is read where the exposition has it (vLLM engines report running
  per engine; an EPP with the in-flight producer reports in-flight per endpoint, and
  running = in-flight - waiting). Without per-unit running, the pool's mean running
  count is the limit only when every unit has work waiting, or flow control holds
  requests (the EPP holds only when its saturation detector says the pool is full).
- ``bound = max(units x min(soft side, hard), floor)`` with ``hard`` = the mean of the
  per-unit limits demonstrated within the window. The spec says "the least"; with KV-cache
  admission a unit's limit moves with the request mix, and the least of them read every site
  full at 70% load in the routing simulator (docs/routing.md).

    in_flight = (mean running + mean waiting per unit) x units + flow-control queue
    raw rho   = max(in_flight / bound, kv_mean + kv_spread)
    rho       = alpha * raw + (1 - alpha) * previous rho, once per new sample
    recent worst rho = the largest rho of the samples taken in the last recent_window_s

Everything here is pure: ``now`` is a monotonic float of seconds passed in by the caller.
"""

from __future__ import annotations

import math
from collections import deque

from gridd.core.readings import LoadSignals, Revision, UnitLoad

DEFAULT_FLOOR = 1.0
DEFAULT_ALPHA = 0.5
DEFAULT_RECENT_WINDOW_S = 10.0
DEFAULT_UNIT_CAPACITY = 8.0
"""Requests one serving unit is assumed to hold before it has shown anything (the prior)."""
DEFAULT_EVIDENCE_WINDOW_S = 60.0
"""How long one sample counts as soft or hard evidence."""
SOFT_PROBE = 1.5
"""The soft side of the bound sits this far above the most held with nothing queued."""


def serving_units(load: LoadSignals) -> int | None:
    """How many serving units the averages stand for, or None when unknown.

    EPP pools publish a fresh ready-endpoint count; a provider pointed at vLLM's own
    /metrics has no such series (ready_endpoints None) and its averages are means over
    the engines it sampled, so the engine count is the multiplier.
    """
    if load.ready_endpoints is not None:
        return load.ready_endpoints
    if load.units:
        return len(load.units)
    return None


def unit_waiting(load: LoadSignals) -> float | None:
    """Requests waiting in the serving units' queues (not flow control), or None."""
    units = serving_units(load)
    if load.avg_waiting is not None and units is not None:
        return load.avg_waiting * units
    known = [u.waiting for u in load.units if u.waiting is not None]
    return sum(known) if known else None


def gateway_in_flight(load: LoadSignals) -> float | None:
    """The gateway's own in-flight reading of one batch (spec: Provider In-flight, last
    paragraph): running plus waiting per endpoint, times ready endpoints, plus what flow
    control holds, all read from the same instant.

    None when it cannot be formed: no mean running count, an unknown unit count, or zero
    ready endpoints (the EPP then leaves its averages frozen at their last value, so they
    say nothing about now).
    """
    units = serving_units(load)
    if units is None or units == 0 or load.avg_running is None:
        return None
    waiting = load.avg_waiting if load.avg_waiting is not None else 0.0
    in_flight = (load.avg_running + waiting) * units + load.flow_queue
    # Finite inputs can still overflow (1e308 x 2): such a reading says nothing usable, and
    # an infinite bound must never reach ordering. Treated like a missing reading.
    return in_flight if math.isfinite(in_flight) else None


def work_waiting(load: LoadSignals) -> bool:
    """Work is waiting (spec: "queue_full per serving unit, or any work held before
    scheduling"): a unit's queue is at its limit, flow control holds requests, or some
    unit has requests waiting to be scheduled."""
    if load.queue_full_units > 0 or load.flow_queue > 0:
        return True
    if load.avg_waiting is not None and load.avg_waiting > 0:
        return True
    return any(u.waiting is not None and u.waiting > 0 for u in load.units)


def nothing_queued(load: LoadSignals) -> bool:
    """Provably nothing queued: the waiting count is exposed and zero, flow control holds
    nothing and no unit's queue is full. An unexposed waiting count proves nothing, so it
    never feeds the soft bound."""
    if load.avg_waiting is None and not any(u.waiting is not None for u in load.units):
        return False
    return not work_waiting(load)


def queue_depth(load: LoadSignals | None) -> float:
    """Requests waiting anywhere in the provider: unit queues plus flow control."""
    if load is None:
        return 0.0
    return (unit_waiting(load) or 0.0) + load.flow_queue


def _own_running(u: UnitLoad) -> float | None:
    """One unit's own running count: its gauge (vLLM), or its in-flight less its queue (EPP
    with the in-flight producer); None when the exposition has neither."""
    if u.running is not None:
        return u.running
    if u.in_flight is not None and u.waiting is not None:
        return max(0.0, u.in_flight - u.waiting)
    return None


def _unit_running(u: UnitLoad, load: LoadSignals) -> float | None:
    """One unit's running count: its own, else the pool mean."""
    running = _own_running(u)
    return running if running is not None else load.avg_running


def every_unit_waits(load: LoadSignals) -> bool:
    """Every serving unit has requests waiting (no per-unit series: the pool mean does)."""
    if load.units:
        return all(u.waiting is not None and u.waiting > 0 for u in load.units)
    return load.avg_waiting is not None and load.avg_waiting > 0


def backlogged(load: LoadSignals) -> bool:
    """The provider holds work it cannot start (spec: "queue_full per serving unit, or any
    work held before scheduling"): a unit's queue is at its configured limit
    (``queue_full_at``), flow control holds requests, or, with no limit configured, every
    serving unit's queue is at least as deep as its batch (a new request would wait about
    a whole service time anywhere in the pool). A queue at one endpoint, or a short queue
    at every endpoint, is what any busy pool shows in passing, not a pool that is full:
    measured in the routing simulator, that reading shed requests at 70% offered load."""
    if load.queue_full_units > 0 or load.flow_queue > 0:
        return True
    if load.units:
        for u in load.units:
            running = _unit_running(u, load)
            if u.waiting is None or u.waiting <= 0 or u.waiting < (running or 0.0):
                return False
        return True
    return (load.avg_waiting is not None and load.avg_waiting > 0
            and load.avg_waiting >= (load.avg_running or 0.0))


def saturated_with_work_waiting(rho: float | None, load: LoadSignals | None) -> bool:
    """A candidate is *full*: saturated (rho >= 1) and backlogged. The one test both
    selection ("sites not full") and shedding use."""
    return rho is not None and rho >= 1.0 and load is not None and backlogged(load)


def demonstrated_unit_limit(load: LoadSignals) -> float | None:
    """The requests one serving unit held at a demonstrated limit in this sample, or None.

    A unit queues only once its own batch is full, so a unit with work waiting shows its
    limit: what it is running. Per-unit running comes from a vLLM engine's own gauge, or
    from an EPP endpoint's in-flight count (in-flight producer) less its queue. Without
    per-unit running, the pool's mean running count is a limit only when every unit has
    work waiting or flow control holds requests: one request queued behind a long one at
    one endpoint while the others idle is not the provider's limit.
    """
    limits: list[float] = []
    for u in load.units:
        if u.waiting is None or u.waiting <= 0:
            continue
        running = _own_running(u)
        if running is not None and running > 0:
            limits.append(running)
    if limits:
        return sum(limits) / len(limits)
    if load.avg_running is None or load.avg_running <= 0:
        return None
    if every_unit_waits(load) or load.flow_queue > 0:
        return load.avg_running
    return None


class _WindowMax:
    """The largest value among samples taken within the last ``window_s`` seconds: a
    monotonic deque (values strictly decreasing left to right), O(1) amortised per sample."""

    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        samples = self._samples
        while samples and samples[-1][1] <= value:
            samples.pop()
        samples.append((now, value))

    def value(self, now: float, window_s: float) -> float | None:
        """The extreme of the samples taken at t with now - t < window_s, or None."""
        samples = self._samples
        while samples and now - samples[0][0] >= window_s:
            samples.popleft()
        return samples[0][1] if samples else None

    def clear(self) -> None:
        self._samples.clear()


class _WindowMean:
    """The mean of the samples taken within the last ``window_s`` seconds."""

    __slots__ = ("_samples", "_sum")

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        self._sum += value

    def value(self, now: float, window_s: float) -> float | None:
        samples = self._samples
        while samples and now - samples[0][0] >= window_s:
            self._sum -= samples.popleft()[1]
        if not samples:
            self._sum = 0.0
            return None
        return self._sum / len(samples)

    def clear(self) -> None:
        self._samples.clear()
        self._sum = 0.0


class CapacityLearner:
    """Learned capacity and smoothed saturation of one candidate (site, provider).

    Feed every batch the store admits for the candidate to :meth:`observe`. Reset rules
    (spec: Provider revisions):

    - a changed provider_uid, generation or publisher_epoch forgets the learned bounds
      and the load and congestion history (smoothed rho and the recent window);
    - missing or stale revision metadata (the caller passes ``revision=None``) and an
      incomplete batch leave the bounds untouched, while the batch's load still moves
      rho against the bounds already held (fresh pressure signals remain usable);
    - a zero-sample revision (``batch_samples == 0``) drops the learned bounds; the load
      history is kept, so a burst seen just before still counts until it ages out;
    - the next newer complete batch with samples learns again, from empty bounds if they
      were dropped (a newer complete batch starts fresh learning);
    - a repeated batch (``new_sample=False``), or one not newer by (epoch, sequence)
      than the last one taken under the same identity, changes nothing.
    """

    __slots__ = (
        "_floor", "_alpha", "_window_s", "_unit_capacity", "_evidence_window_s", "_identity",
        "_last_order", "_soft", "_hard", "_units", "_rho", "_in_flight", "_recent", "_learning",
        "_last_at",
    )

    def __init__(
        self,
        *,
        floor: float = DEFAULT_FLOOR,
        alpha: float = DEFAULT_ALPHA,
        recent_window_s: float = DEFAULT_RECENT_WINDOW_S,
        unit_capacity: float = DEFAULT_UNIT_CAPACITY,
        evidence_window_s: float = DEFAULT_EVIDENCE_WINDOW_S,
    ) -> None:
        self._identity: tuple[str, int, int] | None = None
        self._last_order: tuple[int, int] | None = None
        # Per-unit evidence: soft = most held with nothing queued, hard = mean demonstrated limit.
        self._soft = _WindowMax()
        self._hard = _WindowMean()
        self._units: int | None = None
        self._rho: float | None = None
        self._in_flight: float | None = None
        # Smoothed rho samples over recent_window_s: recent_worst_rho is their maximum.
        self._recent = _WindowMax()
        self._learning = False
        self._last_at: float | None = None
        self.retune(floor=floor, alpha=alpha, recent_window_s=recent_window_s, unit_capacity=unit_capacity,
                    evidence_window_s=evidence_window_s)

    def retune(self, *, floor: float, alpha: float, recent_window_s: float,
               unit_capacity: float = DEFAULT_UNIT_CAPACITY,
               evidence_window_s: float = DEFAULT_EVIDENCE_WINDOW_S) -> None:
        """(Re)set the knobs; a committed reload keeps the learned evidence and rho history."""
        for name, value in (("capacity floor", floor), ("unit capacity", unit_capacity),
                            ("recent window", recent_window_s), ("evidence window", evidence_window_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not (0 < alpha <= 1):
            raise ValueError(f"rho smoothing alpha must be in (0, 1], got {alpha!r}")
        self._floor = float(floor)
        self._alpha = float(alpha)
        self._window_s = float(recent_window_s)
        self._unit_capacity = float(unit_capacity)
        self._evidence_window_s = float(evidence_window_s)

    def observe(
        self,
        now: float,
        revision: Revision | None,
        load: LoadSignals,
        *,
        complete: bool,
        new_sample: bool,
    ) -> None:
        """Take one admitted batch of this candidate.

        revision: the batch's revision metadata, or None when it is missing or stale.
        complete: the batch is qualified and complete (DESIGN 5b).
        new_sample: False for a repeat of a publication already taken.
        """
        if not new_sample:
            return
        if revision is not None:
            identity = (revision.provider_uid, revision.generation, revision.publisher_epoch)
            if identity != self._identity:
                if self._identity is not None:
                    # A recreated object, a spec change or an operator restart: what was
                    # learned describes something else now.
                    self._forget()
                self._identity = identity
                self._last_order = None
            order = (revision.publisher_epoch, revision.batch_sequence)
            if self._last_order is not None and order <= self._last_order:
                return
            self._last_order = order
            if revision.batch_samples == 0:
                self._soft.clear()
                self._hard.clear()

        self._last_at = now
        units = serving_units(load)
        if units:
            self._units = units
        in_flight = gateway_in_flight(load)
        self._in_flight = in_flight
        self._learning = complete and revision is not None and revision.batch_samples > 0
        if self._learning and in_flight is not None and units:
            if nothing_queued(load):
                self._soft.add(now, in_flight / units)
            limit = demonstrated_unit_limit(load)
            if limit is not None:
                self._hard.add(now, limit)

        # Evidence first, then rho: a sample that demonstrates a limit below the current
        # estimate is read against the bound it just set.
        raw: float | None = None
        if in_flight is not None:
            raw = in_flight / self.capacity(now)
        if load.kv_mean is not None:
            kv = load.kv_mean + (load.kv_spread or 0.0)
            raw = kv if raw is None else max(raw, kv)
        if raw is None or math.isnan(raw):
            return
        self._rho = raw if self._rho is None else self._alpha * raw + (1.0 - self._alpha) * self._rho
        self._recent.add(now, self._rho)

    def _forget(self) -> None:
        self._soft.clear()
        self._hard.clear()
        self._units = None
        self._rho = None
        self._in_flight = None
        self._recent.clear()

    def unit_bounds(self, now: float) -> tuple[float | None, float | None]:
        """(soft, hard) per-unit evidence still within the evidence window at ``now``."""
        window = self._evidence_window_s
        return (self._soft.value(now, window), self._hard.value(now, window))

    def capacity(self, now: float) -> float:
        """Capacity in requests at ``now``: units x the lesser of the soft side (the prior, or
        SOFT_PROBE x the most held with nothing queued) and the mean demonstrated limit,
        never below the floor. With no unit count known yet, the floor."""
        return self.capacity_and_bound(now)[0]

    def capacity_and_bound(self, now: float) -> tuple[float, str]:
        """:meth:`capacity` and the term in force: ``prior``, ``soft``, ``hard`` or ``floor``."""
        if self._units is None:
            return self._floor, "floor"
        soft, hard = self.unit_bounds(now)
        per_unit, bound = self._unit_capacity, "prior"
        if soft is not None and SOFT_PROBE * soft > per_unit:
            per_unit, bound = SOFT_PROBE * soft, "soft"
        if hard is not None and hard < per_unit:
            per_unit, bound = hard, "hard"
        if self._units * per_unit < self._floor:
            return self._floor, "floor"
        return self._units * per_unit, bound

    @property
    def unit_capacity(self) -> float:
        """The prior: requests one serving unit is assumed to hold before evidence."""
        return self._unit_capacity

    @property
    def floor(self) -> float:
        return self._floor

    @property
    def bound(self) -> float:
        """Capacity as of the latest new sample (see :meth:`capacity`)."""
        return self.capacity(self._last_at) if self._last_at is not None else self._floor

    @property
    def units(self) -> int | None:
        """Serving units of the latest sample that reported them."""
        return self._units

    @property
    def rho(self) -> float | None:
        """Smoothed saturation after the latest new sample; None before any pressure."""
        return self._rho

    @property
    def in_flight(self) -> float | None:
        """The latest new sample's in-flight reading; None when it could not be formed."""
        return self._in_flight

    @property
    def learning(self) -> bool:
        """Whether the latest new sample was allowed to move the learned bounds."""
        return self._learning

    def recent_worst_rho(self, now: float) -> float | None:
        """The largest smoothed rho among samples taken within recent_window_s before
        ``now`` (a sample taken at t counts while now - t < recent_window_s). None when
        every sample has aged out: the candidate then has no recent reading at all."""
        return self._recent.value(now, self._window_s)
