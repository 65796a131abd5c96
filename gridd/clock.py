"""gridd's wall clock: the one seam every role reads wall time through.

``wall_clock()`` is ``time.time()`` plus an offset read once, at import, from the
environment variable ``GRIDD_WALL_CLOCK_OFFSET_S`` (seconds, may be negative; unset or
empty means 0). It is a test and operations aid, not configuration: it lets a real gridd
process run as if its host clock were set ahead or back (the publisher epoch, published_ms,
admission's skew bound, certificate validity checks), without touching the machine's
clock. The TLS handshake itself (OpenSSL) still checks certificates against the real clock.

Monotonic time (timeouts, intervals, ages) never goes through here: it is trio's clock.
"""

from __future__ import annotations

import math
import os
import time

from gridd.errors import ConfigError

__all__ = ["OFFSET_ENV", "wall_clock", "wall_clock_offset_s"]

OFFSET_ENV = "GRIDD_WALL_CLOCK_OFFSET_S"


def _read_offset(text: str | None) -> tuple[float, str | None]:
    """(offset, problem): a value that is not a finite number is refused at start."""
    if text is None or not text.strip():
        return 0.0, None
    try:
        offset = float(text)
    except ValueError:
        offset = math.nan
    if not math.isfinite(offset):
        return 0.0, f"{OFFSET_ENV}={text!r}: expected a finite number of seconds"
    return offset, None


_OFFSET_S, _OFFSET_PROBLEM = _read_offset(os.environ.get(OFFSET_ENV))


def wall_clock_offset_s() -> float:
    """The offset in effect (0 unless GRIDD_WALL_CLOCK_OFFSET_S is set). ``gridd run`` calls
    it before starting, so a malformed value stops it with ConfigError."""
    if _OFFSET_PROBLEM is not None:
        raise ConfigError(_OFFSET_PROBLEM)
    return _OFFSET_S


def wall_clock() -> float:
    """Unix seconds, shifted by GRIDD_WALL_CLOCK_OFFSET_S."""
    return time.time() + _OFFSET_S
