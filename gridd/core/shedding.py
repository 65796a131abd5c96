"""Per-model load shedding (spec: Site Selection, availability.shedding).

With shedding on, a model sheds (429 with Retry-After) once every healthy site serving it
has been saturated with work waiting continuously for full_after_s, and routes again once
no sample from any site has shown saturation with work waiting for room_after_s. The
room timer is longer than the full timer by default, so a shedding model does not flap.

Time is sampled: the caller calls :meth:`ShedState.observe` after every ingest, and a
condition observed at t is taken to hold until the next observation. Boundaries:

- a saturated run that started at t0 (the first observation of it) sheds from
  ``now >= t0 + full_after_s``; any observation that is not all-saturated ends the run;
- shedding ends from ``now >= t_last + room_after_s``, t_last being the latest
  observation in which some sample showed saturation with work waiting. Leaving the
  shed state also ends the saturated run, so shedding again takes a new observed run of
  full_after_s.
"""

from __future__ import annotations

import math

DEFAULT_FULL_AFTER_MS = 2000
DEFAULT_ROOM_AFTER_MS = 5000
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0


class ShedState:
    """One model's shedding state. Only consulted when availability.shedding is on."""

    __slots__ = ("_full_after_s", "_room_after_s", "_saturated_since", "_last_saturated", "_shedding")

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
        self._saturated_since: float | None = None
        self._last_saturated: float | None = None
        self._shedding = False

    def retune(self, *, full_after_s: float, room_after_s: float) -> None:
        """A committed reload's timers; the current run and shedding state are kept."""
        self._full_after_s, self._room_after_s = float(full_after_s), float(room_after_s)

    def observe(self, now: float, *, all_healthy_saturated: bool, any_sample_saturated: bool) -> None:
        """Record one ingest.

        all_healthy_saturated: every healthy site serving the model is saturated with work
            waiting (OrderedSnapshot.all_full). Pass False when no site is healthy: that
            is a 503, not a shed.
        any_sample_saturated: some site's sample in this ingest showed saturation with
            work waiting (OrderedSnapshot.any_full). Implied by all_healthy_saturated.
        """
        # Settle transitions that fell due before this observation under the old inputs.
        self._advance(now)
        if all_healthy_saturated:
            any_sample_saturated = True
            if self._saturated_since is None:
                self._saturated_since = now
        else:
            self._saturated_since = None
        if any_sample_saturated:
            self._last_saturated = now
        self._advance(now)

    def _advance(self, now: float) -> None:
        if self._shedding:
            if self._last_saturated is None or now - self._last_saturated >= self._room_after_s:
                self._shedding = False
                self._saturated_since = None
        elif self._saturated_since is not None and now - self._saturated_since >= self._full_after_s:
            self._shedding = True

    def shedding(self, now: float) -> bool:
        """Whether the model sheds at ``now`` (``now`` never goes backwards)."""
        self._advance(now)
        return self._shedding

    def retry_after_s(self, now: float) -> float:
        """Seconds until the state can next change, clamped to [1, 60]; the caller adds
        jitter and rounds up for the Retry-After header.

        Shedding: until room_after_s after the latest saturated sample. Not shedding:
        until the current saturated run reaches full_after_s, or full_after_s when no
        run is under way.
        """
        self._advance(now)
        if self._shedding and self._last_saturated is not None:
            wait = self._last_saturated + self._room_after_s - now
        elif self._saturated_since is not None:
            wait = self._saturated_since + self._full_after_s - now
        else:
            wait = self._full_after_s
        return min(max(wait, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
