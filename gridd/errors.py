"""gridd's error tree. Library errors (httpx, ssl, msgspec, OS) are mapped into these at
the layer edge; each carries a short ``reason`` that a metric label can use."""

from __future__ import annotations


class GriddError(Exception):
    reason = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class ConfigError(GriddError):
    """A config file that cannot be used; the message names the exact path of the bad value."""

    reason = "config"


class StateError(GriddError):
    """The state directory cannot be read or written durably."""

    reason = "state"


class ControlError(GriddError):
    """The control socket is absent, dead, or answered something unreadable."""

    reason = "control"
