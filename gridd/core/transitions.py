"""Which state changes get a log line: one per transition, rate-limited per target.

Operators read journald to learn when something broke and when it came back, so each target
(a provider's scrape, a provider's readiness, a peer, a gateway's operator link) logs a line
when its state changes, not per observation. A target that flaps must not flood journald:
each target may log at most ``burst`` lines in any ``window_s`` seconds. Changes beyond that
are counted, not logged; the first line allowed again reports the current state and how many
changes went unlogged, and it is written even when the state came back to the last one
logged, so the log always ends on the truth within one window.

Pure: callers pass every observation (each scrape, each poll) with ``now``; no trio here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

DEFAULT_BURST = 4
DEFAULT_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Transition:
    """A line to log: ``target`` went from ``old`` (the last state logged; None at first
    sight) to ``new``; ``unlogged`` changes happened in between without a line."""

    target: Hashable
    old: str | None
    new: str
    unlogged: int = 0

    def suffix(self) -> str:
        """What to append to the line when changes were held back, else ``""``."""
        return f" ({self.unlogged} more changes not logged: flapping)" if self.unlogged else ""


@dataclass
class _Target:
    logged: str | None
    """The state the last line said (or the silent baseline before any line)."""
    current: str | None = None
    changes: int = 0
    """State changes since the last line (held back when over budget)."""
    lines_at: deque[float] = field(default_factory=deque)


class TransitionLog:
    """Per-target state, the last state logged, and a sliding-window line budget."""

    def __init__(self, *, burst: int = DEFAULT_BURST, window_s: float = DEFAULT_WINDOW_S) -> None:
        if burst < 1 or window_s <= 0:
            raise ValueError("burst must be >= 1 and window_s > 0")
        self.burst = burst
        self.window_s = window_s
        self._targets: dict[Hashable, _Target] = {}

    def observe(self, target: Hashable, state: str, now: float, *,
                baseline: str | None = None) -> Transition | None:
        """Record one observation; return the line to log, if any.

        ``baseline``: a state that needs no line when it is the first one seen (a scrape that
        succeeds, a peer that is up). Any other first state is logged."""
        entry = self._targets.get(target)
        if entry is None:
            entry = self._targets[target] = _Target(logged=baseline, current=baseline)
        if state != entry.current:
            entry.changes += 1
            entry.current = state
        if entry.changes == 0:
            return None
        # Sliding window: the lines of the last window_s seconds, at most `burst` of them.
        while entry.lines_at and now - entry.lines_at[0] >= self.window_s:
            entry.lines_at.popleft()
        if len(entry.lines_at) >= self.burst:
            return None  # held back; the first line allowed again reports the count
        # The line reports logged -> state as one change; the rest went unlogged. Back at
        # the state last logged, every change in between went unlogged.
        unlogged = entry.changes - 1 if state != entry.logged else entry.changes
        line = Transition(target, entry.logged, state, unlogged)
        entry.logged, entry.changes = state, 0
        entry.lines_at.append(now)
        return line

    def forget(self, target: Hashable) -> None:
        """The target is gone (provider removed, peer dropped from the config)."""
        self._targets.pop(target, None)
