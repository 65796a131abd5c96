"""Capacity learning and saturation (rho) for one routing candidate (site, provider).

The gateway never counts its own requests (spec: Site Selection). It reads each
candidate's load from the batches its operator relays and learns, per candidate:

    in_flight = (mean running + mean waiting per unit) x units + flow-control queue
    soft      = the most in_flight seen with nothing queued
    hard      = the least in_flight seen while work was waiting
    bound     = max(min(soft, hard), floor)      (only the learned bounds that exist)
    raw rho   = max(in_flight / bound, kv_mean + kv_spread)
    rho       = alpha * raw + (1 - alpha) * previous rho, once per new sample
    recent worst rho = the largest rho of the samples taken in the last recent_window_s

`units` is the EPP's ready-endpoint count, or for a plain vLLM provider (no
ready-endpoint series) the number of engines sampled. Everything here is pure:
``now`` is a monotonic float of seconds passed in by the caller.
"""

from __future__ import annotations

import math
from collections import deque

from gridd.core.readings import LoadSignals, Revision

DEFAULT_FLOOR = 1.0
DEFAULT_ALPHA = 0.5
DEFAULT_RECENT_WINDOW_S = 30.0


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


def saturated_with_work_waiting(rho: float | None, load: LoadSignals | None) -> bool:
    """A candidate is *full*: saturated (rho >= 1) with work waiting. The one test both
    selection's "sites not full" and shedding's "saturated ... with work waiting" use."""
    return rho is not None and rho >= 1.0 and load is not None and work_waiting(load)


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
        "_floor", "_alpha", "_window_s", "_identity", "_last_order",
        "_soft", "_hard", "_rho", "_in_flight", "_recent", "_learning",
    )

    def __init__(
        self,
        *,
        floor: float = DEFAULT_FLOOR,
        alpha: float = DEFAULT_ALPHA,
        recent_window_s: float = DEFAULT_RECENT_WINDOW_S,
    ) -> None:
        if not (math.isfinite(floor) and floor > 0):
            raise ValueError(f"capacity floor must be a positive number, got {floor!r}")
        if not (0 < alpha <= 1):
            raise ValueError(f"rho smoothing alpha must be in (0, 1], got {alpha!r}")
        if not (math.isfinite(recent_window_s) and recent_window_s > 0):
            raise ValueError(f"recent window must be a positive number of seconds, got {recent_window_s!r}")
        self._floor = float(floor)
        self._alpha = float(alpha)
        self._window_s = float(recent_window_s)
        self._identity: tuple[str, int, int] | None = None
        self._last_order: tuple[int, int] | None = None
        self._soft: float | None = None
        self._hard: float | None = None
        self._rho: float | None = None
        self._in_flight: float | None = None
        # (taken_at, rho) with rho strictly decreasing left to right: the sliding-window
        # maximum is the leftmost entry that has not aged out.
        self._recent: deque[tuple[float, float]] = deque()
        self._learning = False

    def retune(self, *, floor: float, alpha: float, recent_window_s: float) -> None:
        """A committed reload's knobs; learned bounds and the rho history are kept."""
        self._floor, self._alpha, self._window_s = float(floor), float(alpha), float(recent_window_s)

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
                self._soft = None
                self._hard = None

        in_flight = gateway_in_flight(load)
        self._in_flight = in_flight
        self._learning = complete and revision is not None and revision.batch_samples > 0
        if self._learning and in_flight is not None:
            if nothing_queued(load):
                if self._soft is None or in_flight > self._soft:
                    self._soft = in_flight
            elif work_waiting(load):
                if self._hard is None or in_flight < self._hard:
                    self._hard = in_flight

        # Bounds first, then rho: a sample that shows work waiting at a new low lowers the
        # hard bound it is read against, so a candidate that queues reads rho >= 1.
        raw: float | None = None
        if in_flight is not None:
            raw = in_flight / self.bound
        if load.kv_mean is not None:
            kv = load.kv_mean + (load.kv_spread or 0.0)
            raw = kv if raw is None else max(raw, kv)
        if raw is None or math.isnan(raw):
            return
        self._rho = raw if self._rho is None else self._alpha * raw + (1.0 - self._alpha) * self._rho
        recent = self._recent
        while recent and recent[-1][1] <= self._rho:
            recent.pop()
        recent.append((now, self._rho))
        while recent and now - recent[0][0] >= self._window_s:
            recent.popleft()

    def _forget(self) -> None:
        self._soft = None
        self._hard = None
        self._rho = None
        self._in_flight = None
        self._recent.clear()

    @property
    def bound(self) -> float:
        """Capacity in requests: the lesser learned bound, never below the floor. With
        only one bound learned it is that one; with none, the floor."""
        soft, hard = self._soft, self._hard
        if soft is None:
            learned = hard
        elif hard is None:
            learned = soft
        else:
            learned = min(soft, hard)
        return self._floor if learned is None else max(learned, self._floor)

    @property
    def soft_bound(self) -> float | None:
        return self._soft

    @property
    def hard_bound(self) -> float | None:
        return self._hard

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
        for taken_at, rho in self._recent:
            if now - taken_at < self._window_s:
                return rho
        return None
