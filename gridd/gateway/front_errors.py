"""Errors the front answers itself: the OpenAI error body ``{"error": {"message", "type",
"param", "code"}}`` (DESIGN 5) and the Retry-After its 429, 502, 503 and 504 carry."""

from __future__ import annotations

import math
import random

import msgspec

from gridd.http.asgi import Send, send_simple

__all__ = [
    "RETRY_AFTER_JITTER",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "retry_after_seconds",
    "send_error",
]

# Retry-After: the decision's hint clamped to [1, 60] s, plus 0..25 % jitter from the injected
# rng so clients told to come back do not return in step, rounded up to whole seconds.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0
RETRY_AFTER_JITTER = 0.25


def retry_after_seconds(retry_after_s: float, rng: random.Random) -> int:
    """Whole seconds for a Retry-After header: clamp, jitter +0..25 %, round up."""
    base = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, retry_after_s))
    return math.ceil(base * (1.0 + RETRY_AFTER_JITTER * rng.random()))


_json = msgspec.json.Encoder()


async def send_error(send: Send, status: int, message: str, *, type_: str, code: str | None,
                     param: str | None = None, retry_after: int | None = None,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """One error answer, with ``Retry-After: retry_after`` when given and ``extra`` headers."""
    body = _json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})
    headers = list(extra or ())
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode("ascii")))
    await send_simple(send, status, body, b"application/json", headers)
