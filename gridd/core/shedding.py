"""Per-model load shedding (spec: Site Selection, availability.shedding).

With shedding on, a model sheds (429 with Retry-After) once every fresh healthy site
serving it has been *full* (saturated with work waiting at the provider's limit)
continuously for full_after_s, and routes again once some fresh healthy site has had room
(or stopped being full) continuously for room_after_s. A site with no fresh signal never
keeps a model shedding, nor stops it: it has no reading either way. Both timers are 5 s by
default: a burst shorter than that is left to the queues (docs/routing.md, "Shedding").

Decided by the routing-quality issue (docs/routing.md, "Shedding"): the spec's "routes
again once no sample from a site has shown that for room_after_ms" kept every request of a
model at 429 for as long as one site stayed saturated, while another sat idle.

Time is sampled: the caller calls :meth:`ShedState.observe` after every ingest, and a
condition observed at t is taken to hold until the next observation. Boundaries:

- a full run that started at t0 (the first observation with every fresh healthy site
  full) sheds from ``now >= t0 + full_after_s``; any observation that is not all-full
  ends the run;
- a relief run that started at t1 (the first observation, while shedding, in which some
  fresh healthy site is not full) ends shedding from ``now >= t1 + room_after_s``; an
  all-full observation ends the relief run. Leaving the shed state also ends the full
  run, so shedding again takes a new observed run of full_after_s.
"""

from __future__ import annotations

import math

DEFAULT_FULL_AFTER_MS = 5000
"""Measured in the routing simulator: a 2 s run shed a 3.5 s overload burst at 70% offered load;
queues absorb such bursts (docs/routing.md, "Shedding")."""
DEFAULT_ROOM_AFTER_MS = 5000
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0


class ShedState:
    """One model's shedding state. Only consulted when availability.shedding is on."""

    __slots__ = ("_full_after_s", "_room_after_s", "_full_since", "_relief_since", "_shedding")

    def __init__(
        self,
        full_after_s: float = DEFAULT_FULL_AFTER_MS / 1000,
        room_after_s: float = DEFAULT_ROOM_AFTER_MS / 1000,
    ) -> None:
        if not (math.isfinite(full_after_s) and full_after_s >= 0):
            raise ValueError(f"full_after_s must be a non-negative number of seconds, got {full_after_s!r}")
        if not (math.isfinite(room_after_s) and room_after_s > 0):
            raise ValueError(f"room_after_s must be a positive number of seconds, got {room_after_s!r}")
        self._full_after_s = float(full_after_s)
        self._room_after_s = float(room_after_s)
        self._full_since: float | None = None
        self._relief_since: float | None = None
        self._shedding = False

    def retune(self, *, full_after_s: float, room_after_s: float) -> None:
        """A committed reload's timers; the current runs and shedding state are kept."""
        self._full_after_s, self._room_after_s = float(full_after_s), float(room_after_s)

    def observe(self, now: float, *, all_full: bool) -> None:
        """Record one ingest.

        all_full: every fresh healthy site serving the model is full
            (OrderedSnapshot.all_full). False when no fresh site is healthy: no site is
            then known full (stale ones have no reading; none healthy is a 503).
        """
        # Settle transitions that fell due before this observation under the old inputs.
        self._advance(now)
        if all_full:
            self._relief_since = None
            if self._full_since is None:
                self._full_since = now
        else:
            self._full_since = None
            if self._relief_since is None:
                self._relief_since = now
        self._advance(now)

    def _advance(self, now: float) -> None:
        if self._shedding:
            if self._relief_since is not None and now - self._relief_since >= self._room_after_s:
                self._shedding = False
                self._full_since = None
        elif self._full_since is not None and now - self._full_since >= self._full_after_s:
            self._shedding = True
            self._relief_since = None

    @property
    def full_since(self) -> float | None:
        """Start of the full run under way (every fresh healthy site full), or None."""
        return self._full_since

    @property
    def relief_since(self) -> float | None:
        """Start of the relief run under way (some fresh healthy site not full), or None."""
        return self._relief_since

    def shedding(self, now: float) -> bool:
        """Whether the model sheds at ``now`` (``now`` never goes backwards)."""
        self._advance(now)
        return self._shedding

    def retry_after_s(self, now: float) -> float:
        """Seconds until the state can next change, clamped to [1, 60]; the caller adds
        jitter and rounds up for the Retry-After header.

        Shedding: until room_after_s into the current relief run, or room_after_s when
        every site is still full. Not shedding: until the current full run reaches
        full_after_s, or full_after_s when no run is under way.
        """
        self._advance(now)
        if self._shedding:
            relief = self._relief_since
            wait = self._room_after_s if relief is None else relief + self._room_after_s - now
        elif self._full_since is not None:
            wait = self._full_since + self._full_after_s - now
        else:
            wait = self._full_after_s
        return min(max(wait, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
